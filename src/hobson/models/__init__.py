"""Looped language models in plain torch (no ``trust_remote_code``), under their checkpoints' names.

- :mod:`hobson.models.huginn`: Huginn-0125 (``huginn_raven``), recurrent depth with latent state.
- :mod:`hobson.models.nanbeige`: Nanbeige4.2-3B (``nanbeige``), a Llama stack run ``num_loops`` times.
- :mod:`hobson.models.providers`: the looped models' providers: build, load, export.
- :mod:`hobson.models.hf`: the provider of any other causal LM transformers knows.
- :mod:`hobson.models.registry`: :func:`get_provider` by ``model_type``, over both.
- :mod:`hobson.models.logprobs`: token log-probs, shared by the rollout engines and the trainer.
- :mod:`hobson.models.common`: RMSNorm, the KV cache, attention masks, checkpoint directories.
"""

from hobson.models.common import CheckpointError, KVCache
from hobson.models.providers import PROVIDERS, Provider, count_parameters
from hobson.models.registry import get_provider, tiny_config

__all__ = [
    "PROVIDERS",
    "CheckpointError",
    "KVCache",
    "Provider",
    "count_parameters",
    "get_provider",
    "tiny_config",
]
