"""Model providers: build, load and export the looped models under their native parameter names.

A provider is chosen by ``model_type`` in the model's ``config.json``
(:func:`hobson.models.get_provider`, in :mod:`hobson.models.registry`); any other ``model_type``
that transformers maps to a causal LM (Llama, Qwen3, ...) gets
:class:`hobson.models.hf.HFCausalLMProvider`::

    provider = get_provider("path/to/huginn-0125")        # or a config dict / config object
    actor = provider.load("path/to/huginn-0125", dtype=torch.float16)
    critic = provider.load("path/to/huginn-0125", critic=True)   # trunk + fresh value_head
    provider.export(actor, "publications/v0001")          # same names as the checkpoint

Loading refuses, naming the file and tensor: missing or unexpected names, wrong shapes, and for
Huginn a tied embedding whose two stored aliases (``transformer.wte.weight``, ``lm_head.weight``)
differ, or a stored ``freqs_cis`` that is not the RoPE table of the config. Critics
(``value_head`` instead of the LM head) are refused by :meth:`Provider.export` unless asked for,
so they never end up in a policy publication.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hobson.errors import ConfigError
from hobson.models import huginn, nanbeige
from hobson.models.common import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPE_NAMES,
    CheckpointError,
    SafetensorsDir,
    check_names,
    copy_into,
    generator_normal_,
    read_config,
    write_checkpoint,
)

# A stored RoPE table may differ from one recomputed here by float rounding of cos/sin on other
# hardware (~1e-7); a wrong base, length or layout differs by far more than this.
FREQS_ATOL = 1e-5


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied weight counts once; buffers are not parameters)."""
    return sum(p.numel() for p in model.parameters())


class Provider:
    """Build/load/export for one ``model_type``. Subclasses fill the class attributes and hooks."""

    model_type: str = ""
    config_cls: Any = None
    model_cls: Any = None

    # ---------------------------------------------------------------- config
    def config(self, source: Any) -> Any:
        """A config object from a config object, a config.json dict, a model dir or config.json path."""
        if isinstance(source, self.config_cls):
            return source
        if isinstance(source, dict):
            return self.config_cls.from_dict(source)
        return self.config_cls.from_dict(_read_config_source(source))

    def tiny_config(self, **overrides: Any) -> Any:
        raise NotImplementedError

    # ---------------------------------------------------------------- build
    def build_actor(
        self, config: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
    ) -> nn.Module:
        """The policy model with deterministic random weights (``seed``); ``device="meta"`` allocates nothing."""
        return self._build(self.config(config), False, dtype, device, seed, init=True)

    def build_critic(
        self, config: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
    ) -> nn.Module:
        """The critic: the same trunk with ``value_head`` Linear(E, 1, bias=False) instead of the LM head."""
        return self._build(self.config(config), True, dtype, device, seed, init=True)

    def _build(
        self, cfg: Any, critic: bool, dtype: torch.dtype, device: str | torch.device, seed: int, init: bool
    ) -> nn.Module:
        with torch.device("meta"):
            model = self.model_cls(cfg, critic=critic)
        model.to(dtype=dtype)
        if torch.device(device).type == "meta":
            return model.to(device="meta")  # the RoPE table is computed on the CPU
        model.to_empty(device=device)
        self._after_materialize(model)
        if init:
            model.init_weights(seed)
        return model

    def _after_materialize(self, model: nn.Module) -> None:
        """Restore what ``to_empty`` cannot keep (tied weights, computed buffers)."""

    # ---------------------------------------------------------------- load
    def load(
        self,
        model_dir: str | os.PathLike,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        critic: bool = False,
        seed: int = 0,
        tensors: dict[str, torch.Tensor] | None = None,
        config: dict[str, Any] | None = None,
    ) -> nn.Module:
        """Load a checkpoint directory (``model.safetensors`` or shards + index) by native names.

        Tensors are cast to ``dtype``. With ``critic=True`` the LM head is ignored and a
        ``value_head`` is loaded if present, else initialised from ``seed``. ``tensors``: the
        directory's tensors already read (and verified) by the caller, used instead of a re-read.
        With ``config`` too (a publication received over a weight transport) no file is opened:
        ``model_dir`` then only names the source in errors.
        """
        if config is not None and tensors is not None:
            cfg = self.config(config)
            ckpt = SafetensorsDir.of_tensors(model_dir, tensors)
        else:
            cfg = self.config(read_config(model_dir))
            ckpt = SafetensorsDir(model_dir, tensors)
        model = self._build(cfg, critic, dtype, device, seed, init=False)
        names = self._check_checkpoint(ckpt, model)
        copy_into(model, ckpt, names)
        if critic and "value_head.weight" not in ckpt.files:
            generator_normal_([(model.value_head.weight, self._value_head_std(cfg))], seed)
        return model

    def _check_checkpoint(self, ckpt: SafetensorsDir, model: nn.Module) -> list[str]:
        """Refuse an inconsistent checkpoint; return the names to copy into ``model``."""
        expected = set(model.state_dict())
        extra_ok, optional = set(), set()
        if model.critic:
            extra_ok.add("lm_head.weight")  # a policy checkpoint initialises a critic
            optional.add("value_head.weight")
        check_names(ckpt, expected | extra_ok, optional | extra_ok)
        return sorted(expected & set(ckpt.names()))

    def _value_head_std(self, cfg: Any) -> float:
        raise NotImplementedError

    # ---------------------------------------------------------------- export
    def export(
        self,
        model: nn.Module,
        out_dir: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        allow_critic: bool = False,
    ) -> list[Path]:
        """Write ``config.json`` and the weights under the checkpoint's names; returns the files.

        ``dtype``: cast floating tensors (default: keep each tensor's dtype). A critic is refused
        unless ``allow_critic`` (a critic is never part of a policy publication).
        """
        tensors, config = self.export_state(model, dtype=dtype, allow_critic=allow_critic)
        return write_checkpoint(out_dir, tensors, config, max_shard_bytes)

    def export_state(
        self, model: nn.Module, *, dtype: torch.dtype | None = None, allow_critic: bool = False,
        device: str | torch.device | None = "cpu",
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, config)``: exactly what :meth:`export` writes (names, dtypes, config.json), in
        memory, so a weight transport can send a publication without the disk. ``device=None``
        leaves each tensor where it is (a GPU broadcast needs no host copy)."""
        if getattr(model, "critic", False) and not allow_critic:
            raise ValueError("refusing to export a critic (value_head) as a policy; pass allow_critic=True")
        tensors = {}
        for name, t in self._export_tensors(model).items():
            t = t.detach() if device is None else t.detach().to(device)
            if dtype is not None and t.is_floating_point() and name not in self._fp32_buffers:
                t = t.to(dtype)
            tensors[name] = t.contiguous()
        config = model.config.to_dict()
        weight_dtypes = {t.dtype for n, t in tensors.items() if t.is_floating_point() and n not in self._fp32_buffers}
        if len(weight_dtypes) == 1:
            name = DTYPE_NAMES.get(weight_dtypes.pop(), config.get("torch_dtype"))
            config.update(dict.fromkeys(self._dtype_keys, name))
        return tensors, config

    _fp32_buffers: frozenset[str] = frozenset()  # kept in float32 whatever ``dtype`` (Huginn's RoPE table)
    _dtype_keys: tuple[str, ...] = ("torch_dtype",)  # where config.json names the weights' dtype

    def _export_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return dict(model.state_dict())


class HuginnProvider(Provider):
    model_type = huginn.MODEL_TYPE
    config_cls = huginn.HuginnConfig
    model_cls = huginn.HuginnRaven
    _fp32_buffers = frozenset({"freqs_cis"})
    ALIASES = ("transformer.wte.weight", "lm_head.weight")

    def tiny_config(self, **overrides: Any) -> huginn.HuginnConfig:
        return huginn.tiny_config(**overrides)

    def _after_materialize(self, model: nn.Module) -> None:
        model.tie_weights()
        model.freqs_cis = model.expected_freqs_cis().to(model.freqs_cis.device)

    def _value_head_std(self, cfg: huginn.HuginnConfig) -> float:
        return cfg.init_std

    def _check_checkpoint(self, ckpt: SafetensorsDir, model: nn.Module) -> list[str]:
        wte, head = self.ALIASES
        expected = set(model.state_dict())
        optional = {"freqs_cis", wte, head}
        extra_ok = {head}
        if model.critic:
            optional.add("value_head.weight")
        check_names(ckpt, expected | extra_ok, optional)
        have = set(ckpt.names())
        if wte not in have and head not in have:
            raise CheckpointError(f"{ckpt.dir}: the tied embedding is missing (neither {wte} nor {head})")
        if wte in have and head in have:
            a, b = ckpt.get(wte), ckpt.get(head)
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "n/a (shapes differ)"
                raise CheckpointError(
                    f"{ckpt.dir}: tied aliases differ: {head} ({ckpt.path(head).name}) != {wte} "
                    f"({ckpt.path(wte).name}), max |diff| {diff}; a tied checkpoint stores the same tensor twice"
                )
        if "freqs_cis" in have:
            self._check_freqs(ckpt, model)
        names = sorted((expected & have) - {head})
        if wte not in have:
            # only the lm_head alias is stored: it is the tied embedding
            model.transformer.wte.weight.data.copy_(ckpt.get(head).to(model.transformer.wte.weight.dtype))
        return names

    def _check_freqs(self, ckpt: SafetensorsDir, model: nn.Module) -> None:
        stored = ckpt.get("freqs_cis")
        want = model.expected_freqs_cis()
        where = f"{ckpt.path('freqs_cis')}: freqs_cis"
        cfg = model.config
        if list(stored.shape) != list(want.shape):
            raise CheckpointError(
                f"{where} has shape {list(stored.shape)}; the config (head_dim {cfg.head_dim}, block_size "
                f"{cfg.block_size}) implies {list(want.shape)}"
            )
        if stored.dtype != torch.float32:
            raise CheckpointError(f"{where} is {stored.dtype}; the RoPE table must be stored in float32")
        diff = (stored - want.to(stored.device)).abs()  # tensors handed over on a GPU stay there
        if not bool(torch.isfinite(stored).all()) or float(diff.max()) > FREQS_ATOL:
            pos = int(diff.flatten().argmax()) // (want.shape[3] * 2)
            raise CheckpointError(
                f"{where} differs from the RoPE table of this config (rope_base {cfg.rope_base}, head_dim "
                f"{cfg.head_dim}): max |diff| {float(diff.max()):.3g} at position {pos} > {FREQS_ATOL}; "
                "the weights belong to another model revision"
            )

    def _export_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        tensors = dict(model.state_dict())
        if "lm_head.weight" in tensors:
            # safetensors refuses shared storage; the official checkpoint stores a second copy
            tensors["lm_head.weight"] = tensors["lm_head.weight"].detach().clone()
        tensors["freqs_cis"] = tensors["freqs_cis"].float()
        return tensors


class NanbeigeProvider(Provider):
    model_type = nanbeige.MODEL_TYPE
    config_cls = nanbeige.NanbeigeConfig
    model_cls = nanbeige.NanbeigeLooped

    def tiny_config(self, **overrides: Any) -> nanbeige.NanbeigeConfig:
        return nanbeige.tiny_config(**overrides)

    def _value_head_std(self, cfg: nanbeige.NanbeigeConfig) -> float:
        return cfg.initializer_range


PROVIDERS: dict[str, Provider] = {p.model_type: p for p in (HuginnProvider(), NanbeigeProvider())}


def _read_config_source(source: str | os.PathLike) -> dict[str, Any]:
    """The config.json dict of a model directory or a config.json path (also hf.py's and registry.py's)."""
    path = Path(source)
    if path.is_dir():
        return read_config(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such model directory or config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
