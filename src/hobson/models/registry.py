"""Which provider serves a model: :func:`get_provider` by ``model_type``, and :func:`tiny_config`.

The looped models' providers (:data:`hobson.models.providers.PROVIDERS`) come first; any other
``model_type`` that transformers maps to a causal LM gets :class:`hobson.models.hf.HFCausalLMProvider`.
The lookup sits above both provider modules because the HF provider subclasses
:class:`~hobson.models.providers.Provider`: were the lookup in providers.py, each would import the other.
"""

from __future__ import annotations

import os
from typing import Any

from hobson.errors import ConfigError
from hobson.models.hf import HFCausalLMProvider, is_causal_lm_type
from hobson.models.providers import PROVIDERS, Provider, _read_config_source


def get_provider(model_dir_or_config: Any) -> Provider:
    """The provider for a model directory, a config.json path, a config dict or a config object."""
    if isinstance(model_dir_or_config, Provider):
        return model_dir_or_config
    for provider in PROVIDERS.values():
        if isinstance(model_dir_or_config, provider.config_cls):
            return provider
    if not isinstance(model_dir_or_config, (dict, str, os.PathLike)):
        from transformers import PretrainedConfig

        if isinstance(model_dir_or_config, PretrainedConfig):
            return HFCausalLMProvider()
    if isinstance(model_dir_or_config, dict):
        raw, where = model_dir_or_config, "config"
    else:
        raw, where = _read_config_source(model_dir_or_config), str(model_dir_or_config)
    model_type = raw.get("model_type")
    if model_type in PROVIDERS:
        return PROVIDERS[model_type]
    if is_causal_lm_type(model_type):
        return HFCausalLMProvider()
    raise ConfigError(
        f"{where}: model_type {model_type!r} has no provider; supported: {', '.join(sorted(PROVIDERS))} "
        "and the causal LMs of transformers (AutoModelForCausalLM)"
    )


def tiny_config(kind: str, **overrides: Any) -> Any:
    """A tiny config of ``kind`` (``huginn_raven`` or ``nanbeige``) for CPU tests."""
    if kind not in PROVIDERS:
        raise ConfigError(f"unknown model kind {kind!r}; supported: {', '.join(sorted(PROVIDERS))}")
    return PROVIDERS[kind].tiny_config(**overrides)
