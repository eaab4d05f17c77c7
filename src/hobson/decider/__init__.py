"""The decider: a LoRA-adapted causal-LM torso with an option readout, its loss and its training.

Modules: ``config`` (the YAML training config), ``collate`` (rendering and batches), ``sampler``
(length-grouped steps and their split over ranks), ``model`` (torso, LoRA, heads, frozen readout),
``loss``, ``checkpoint`` (self-describing directories) and ``train`` (the recipe); after training:
``predict`` (loading a checkpoint, probabilities, the replay scorer), ``distill`` (the final
teacher file), ``calibrate`` (temperatures), ``metrics`` and ``evaluate`` (reports), ``plots``,
``compare`` (McNemar between checkpoints), ``soup``, ``ask`` and ``release`` (soup, calibrate,
evaluate).
"""
