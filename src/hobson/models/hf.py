"""Plain HF causal LMs (Llama, Qwen3, ... any ``AutoModelForCausalLM``) as RL actors and critics.

:func:`hobson.models.get_provider` picks :class:`HFCausalLMProvider` for a ``model_type`` that is
neither ``huginn_raven`` nor ``nanbeige`` and that transformers maps to a causal LM, so
``python -m jobs.rl --model DIR`` trains them through the same loop, trainer, checkpoints and
publications as the looped models, with the native engine or vLLM.

:class:`HFCausalLM` is a thin ``nn.Module`` around the HF model. It registers the HF model's
children as its own, so its ``state_dict`` carries the HF names unchanged (``model.layers.0...``,
``lm_head.weight``), and adds what the loop and :class:`hobson.rollout.engine.NativeEngine` call:

- ``forward(input_ids, attention_mask=, position_ids=)``: fp32 logits ``(B, T, V)``, or values
  ``(B, T)`` for the critic (the loop's right-padded batches need neither mask nor positions:
  attention is causal, so padding at the end changes no earlier position);
- ``new_cache()``, ``prefill(ids, cache, attention_mask=, position_ids=)`` (logits for every
  position) and ``decode_step(tokens (B,), cache, attention_mask=(B, 1), position_ids=(B, 1))``
  (logits ``(B, V)``): HF's ``DynamicCache`` plus the 2D key mask accumulated over the calls, so
  left-padded prompts with per-row positions decode as the trainer scores them;
- ``gradient_checkpointing = True`` (what the trainer sets for ``--recompute``) turns on HF's
  activation checkpointing.

The critic is the same torso (the HF base model, under its usual prefix) with ``value_head``
Linear(hidden, 1, bias=False) instead of the LM head; :meth:`HFCausalLMProvider.export` refuses it
unless asked, so it never appears in a publication. Loading goes through ``from_pretrained``
(shards, dtype casts, tied embeddings) and refuses missing, unexpected or mismatched tensors and
a tied embedding stored twice with different values, naming them. Export writes the
``state_dict`` names; a tied ``lm_head.weight`` is written as its own copy (safetensors refuses
shared storage; vLLM and ``from_pretrained`` both accept it).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hobson.errors import ConfigError
from hobson.models.common import (
    CachedDecoding,
    CheckpointError,
    Linear,
    SafetensorsDir,
    generator_normal_,
)
from hobson.models.providers import Provider, _read_config_source

MODEL_TYPE = "hf-causal-lm"
VALUE_HEAD = "value_head.weight"


def is_causal_lm_type(model_type: Any) -> bool:
    """Whether transformers maps ``model_type`` to an ``AutoModelForCausalLM`` class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


class HFCache:
    """HF's ``DynamicCache`` and the key mask ``(B, S)`` of every position stored so far."""

    def __init__(self, config: Any) -> None:
        from transformers import DynamicCache

        self.kv = DynamicCache(config=config)
        self.key_mask: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.key_mask is None else int(self.key_mask.shape[1])

    def extend(self, attention_mask: Tensor | None, batch: int, new: int, device: torch.device) -> Tensor:
        """Append the new tokens' mask (None: all real); returns the mask of all keys ``(B, S)``."""
        cur = (
            torch.ones(batch, new, dtype=torch.long, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.long)
        )
        self.key_mask = cur if self.key_mask is None else torch.cat([self.key_mask, cur], dim=1)
        return self.key_mask


class HFCausalLM(CachedDecoding, nn.Module):
    """An HF causal LM (actor) or its torso with a value head (critic), under the HF names."""

    def __init__(self, hf: nn.Module, critic: bool = False) -> None:
        super().__init__()
        if hf._parameters or hf._buffers:
            raise ConfigError(f"{type(hf).__name__} holds tensors outside its submodules; not supported")
        self.config = hf.config
        self.critic = critic
        if critic:
            net = hf.base_model
            if net is hf:
                raise ConfigError(f"{type(hf).__name__} has no base model ({hf.base_model_prefix!r}) for a critic")
            self.add_module(hf.base_model_prefix, net)
            self.value_head = Linear(self.config.get_text_config().hidden_size, 1, bias=False)
        else:
            net = hf
            for name, child in hf.named_children():
                self.add_module(name, child)
        # the module that runs the forward; not registered (its children are, under the HF names)
        object.__setattr__(self, "net", net)
        params = inspect.signature(net.forward).parameters
        # newer transformers (5.24) name the KV cache argument ``cache``, older ``past_key_values``
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._recompute = False

    # ------------------------------------------------------------------ training
    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        self.net.training = mode  # the HF top-level flag (the net itself is not a registered child)
        return self

    @property
    def gradient_checkpointing(self) -> bool:
        return self._recompute

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        net = self.net
        if on:
            # non-reentrant: recomputation needs no input that requires grad
            # newer transformers: activation_checkpointing_enable (gradient_checkpointing_enable deprecated)
            enable = getattr(net, "activation_checkpointing_enable", None)
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self._recompute:
            disable = getattr(net, "activation_checkpointing_disable", None) or net.gradient_checkpointing_disable
            disable()
        self._recompute = bool(on)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        *,
        cache: HFCache | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` (actor) or values ``(B, T)`` (critic), fp32.

        ``cache``: append to this cache; ``attention_mask`` ``(B, T)`` marks the real new tokens;
        ``position_ids`` ``(B, T)`` (default: cache length + arange(T)).
        """
        kw: dict[str, Any] = {"use_cache": cache is not None}
        if cache is not None:
            B, T = input_ids.shape
            attention_mask = cache.extend(attention_mask, B, T, input_ids.device)
            kw[self._cache_arg] = cache.kv
        out = self.net(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)
        if self.critic:
            return self.value_head(out.last_hidden_state).squeeze(-1).float()
        return out.logits.float()

    def new_cache(self) -> HFCache:
        return HFCache(self.config)


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No "Loading weights" bar: the engine loads a publication every update."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of ``state_dict`` names that share one tensor (a tied embedding and LM head)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.device.type != "meta":
            groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


class HFCausalLMProvider(Provider):
    """Build/load/export :class:`HFCausalLM` actors and critics (see the module docstring)."""

    model_type = MODEL_TYPE

    # ---------------------------------------------------------------- config
    def config(self, source: Any) -> Any:
        """An HF config from a config object, a config.json dict, a model dir or config.json path."""
        from transformers import PretrainedConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if isinstance(source, PretrainedConfig):
            return source
        raw = dict(source) if isinstance(source, dict) else _read_config_source(source)
        model_type = raw.get("model_type")
        if not is_causal_lm_type(model_type):
            where = "config" if isinstance(source, dict) else str(source)
            raise ConfigError(f"{where}: model_type {model_type!r} is not a causal LM that transformers knows")
        return CONFIG_MAPPING[model_type].from_dict(raw)

    def tiny_config(self, arch: str = "qwen3", **overrides: Any) -> Any:
        """A tiny random model config for CPU tests (vocabulary 256, the byte tokenizer's; head_dim 32,
        the smallest vLLM's CPU attention takes): ``qwen3`` with a tied embedding, or ``llama`` untied."""
        from transformers import LlamaConfig, Qwen3Config

        kw: dict[str, Any] = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=256,
            max_position_embeddings=512 if arch == "qwen3" else 256,
            tie_word_embeddings=arch == "qwen3",
            bos_token_id=1,
            eos_token_id=0,
            pad_token_id=0,
        )
        kw.update(overrides)
        classes = {"qwen3": Qwen3Config, "llama": LlamaConfig}
        if arch not in classes:
            raise ConfigError(f"tiny_config: arch {arch!r} is not one of {sorted(classes)}")
        return classes[arch](**kw)

    # ---------------------------------------------------------------- build
    def _from_config(self, cfg: Any, dtype: torch.dtype, device: str | torch.device, seed: int) -> nn.Module:
        from transformers import AutoModelForCausalLM

        if torch.device(device).type == "meta":
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        # HF initialises from the global generator: seed a fork of it, leave the caller's alone
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf = AutoModelForCausalLM.from_config(cfg)
        return hf.to(device=device, dtype=dtype)

    def build_actor(
        self, config: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
    ) -> HFCausalLM:
        """The policy with deterministic random weights (``seed``); ``device="meta"`` allocates nothing."""
        return HFCausalLM(self._from_config(self.config(config), dtype, device, seed)).eval()

    def build_critic(
        self, config: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
    ) -> HFCausalLM:
        """The critic: the torso of ``build_actor(config, seed=seed)`` and a ``value_head`` from ``seed``."""
        cfg = self.config(config)
        critic = HFCausalLM(self._from_config(cfg, dtype, device, seed), critic=True)
        critic.value_head.to(device=device, dtype=dtype)
        if torch.device(device).type != "meta":
            generator_normal_([(critic.value_head.weight, self._value_head_std(cfg))], seed)
        return critic.eval()

    def _value_head_std(self, cfg: Any) -> float:
        return float(getattr(cfg.get_text_config(), "initializer_range", 0.02))

    # ---------------------------------------------------------------- load
    def load(
        self,
        model_dir: str | os.PathLike,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        critic: bool = False,
        seed: int = 0,
    ) -> HFCausalLM:
        """Load an HF checkpoint directory by its names (``from_pretrained``), cast to ``dtype``.

        Refused (:class:`CheckpointError`, naming the directory and tensors): tensors the model
        needs but the directory lacks, tensors the model has no place for, wrong shapes, and a
        tied embedding whose two stored names hold different values. With ``critic=True`` the
        LM head is dropped and ``value_head.weight`` is loaded if stored, else drawn from ``seed``.
        """
        from transformers import AutoModelForCausalLM

        model_dir = Path(model_dir)
        cfg = self.config(model_dir)
        ckpt = SafetensorsDir(model_dir)
        stored = set(ckpt.names())
        try:
            with _quiet_progress():
                hf, info = AutoModelForCausalLM.from_pretrained(
                    str(model_dir), config=cfg, dtype=dtype, output_loading_info=True
                )
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"{model_dir}: cannot be loaded as {type(cfg).__name__}: {e}") from e
        missing = set(info.get("missing_keys", ()))
        unexpected = set(info.get("unexpected_keys", ()))
        if critic:
            unexpected.discard(VALUE_HEAD)
            missing -= {n for n in missing if n.startswith("lm_head.")}  # a critic checkpoint has no head
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {', '.join(sorted(missing)[:8])}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(sorted(unexpected)[:8])}")
        mismatched = [str(m) for m in info.get("mismatched_keys", ())]
        if mismatched:
            problems.append(f"wrong shapes: {', '.join(sorted(mismatched)[:8])}")
        if problems:
            raise CheckpointError(f"{model_dir}: names do not match {type(hf).__name__}: {'; '.join(problems)}")
        self._check_tied(hf, cfg, ckpt, stored)
        if not critic:
            return HFCausalLM(hf.to(device)).eval()
        model = HFCausalLM(hf, critic=True)
        del hf  # the LM head goes with it
        model.to(device=device, dtype=dtype)
        if VALUE_HEAD in stored:
            value = ckpt.get(VALUE_HEAD)
            if list(value.shape) != list(model.value_head.weight.shape):
                raise CheckpointError(
                    f"{ckpt.path(VALUE_HEAD)}: {VALUE_HEAD} has shape {list(value.shape)}, the model "
                    f"{list(model.value_head.weight.shape)}"
                )
            with torch.no_grad():
                model.value_head.weight.copy_(value)
        else:
            generator_normal_([(model.value_head.weight, self._value_head_std(cfg))], seed)
        return model.eval()

    def _check_tied(self, hf: nn.Module, cfg: Any, ckpt: SafetensorsDir, stored: set[str]) -> None:
        inp, out = hf.get_input_embeddings(), hf.get_output_embeddings()
        if out is None or not getattr(cfg.get_text_config(), "tie_word_embeddings", False):
            return
        names = {m: n for n, m in hf.named_modules() if m is inp or m is out}
        a, b = f"{names[inp]}.weight", f"{names[out]}.weight"
        if a in stored and b in stored:
            ta, tb = ckpt.get(a), ckpt.get(b)
            if ta.shape != tb.shape or ta.dtype != tb.dtype or not torch.equal(ta, tb):
                raise CheckpointError(
                    f"{ckpt.dir}: tied aliases differ: {b} ({ckpt.path(b).name}) != {a} ({ckpt.path(a).name}); "
                    "the config ties them (tie_word_embeddings), so a checkpoint stores the same tensor twice"
                )
        if out.weight is not inp.weight:
            raise CheckpointError(f"{ckpt.dir}: {b} is not tied to {a} after loading, though the config ties them")

    # ---------------------------------------------------------------- export (Provider.export)
    # transformers 5 reads ``dtype``; older readers (vLLM's pinned transformers) ``torch_dtype``
    _dtype_keys = ("dtype", "torch_dtype")

    def _export_tensors(self, model: nn.Module) -> dict[str, Tensor]:
        tensors = dict(model.state_dict())
        for group in _tied_names(model):
            for name in group[1:]:
                # safetensors refuses shared storage: later aliases are written as their own copy
                tensors[name] = tensors[name].detach().clone()
        return tensors
