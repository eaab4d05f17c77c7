"""The decider: a LoRA-adapted causal-LM torso with an option readout, its loss and its training.

Modules: ``config`` (the YAML training config), ``collate`` (rendering and batches), ``sampler``
(length-grouped steps and their split over ranks), ``model`` (torso, LoRA, heads, frozen readout),
``loss``, ``checkpoint`` (self-describing directories) and ``train`` (the recipe).
"""
