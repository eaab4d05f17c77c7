"""Model soups: one checkpoint that is the mean of ``N`` fine-tunes of the same config.

LoRA: each adapted module of fine-tune ``i`` adds ``dW_i = (alpha / r) B_i A_i`` with
``A_i (r, in)`` and ``B_i (out, r)``. The soup stacks the ``A_i`` into ``A = [A_1; ...; A_N]``
``(N r, in)`` and concatenates the ``B_i`` divided by ``N`` into ``B = [B_1 ... B_N] / N``
``(out, N r)``, with ``lora_r = N r`` and ``lora_alpha = N alpha`` (so ``alpha / r`` is unchanged):

    dW = (N alpha / (N r)) B A = (alpha / r) (1/N) sum_i B_i A_i = (1/N) sum_i dW_i

exactly the mean update, as an ordinary rank-``N r`` LoRA. Heads: the ``N`` heads are kept side
by side in an :class:`~hobson.decider.model.EnsembleHead` (``head_ensemble = N``) whose logits
are the mean of the heads' logits. A soup of soups works the same way (``N`` ensembles of ``m``
heads become one of ``N m``; all inputs have the same ``m``, so it is still the plain mean).

The inputs' configs must be equal except for :data:`SOUP_FREE_KEYS` (seeds and run control: what
makes the fine-tunes different runs, not different models); temperatures are not part of the config
and the soup's are reset to 1 (calibrate the soup afterwards).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from hobson.decider.checkpoint import load_checkpoint, save_checkpoint
from hobson.decider.config import RUN_CONTROL_KEYS
from hobson.errors import ConfigError

SOUP_FREE_KEYS = RUN_CONTROL_KEYS | {"seed", "soup_of", "init_from"}


def config_differences(configs: Sequence[dict], names: Sequence[str]) -> list[str]:
    """``key: name=value, ...`` for every key (outside SOUP_FREE_KEYS) whose values differ."""
    keys = sorted(set().union(*configs) - SOUP_FREE_KEYS)
    out = []
    for k in keys:
        values = [c.get(k) for c in configs]
        if any(v != values[0] for v in values[1:]):
            out.append(f"{k}: " + ", ".join(f"{n}={v!r}" for n, v in zip(names, values, strict=True)))
    return out


def _head_members(head: dict[str, torch.Tensor], ensemble: int) -> list[dict[str, torch.Tensor]]:
    if ensemble == 1:
        return [head]
    members: list[dict[str, torch.Tensor]] = [{} for _ in range(ensemble)]
    for k, v in head.items():
        _, i, rest = k.split(".", 2)  # heads.<i>.<name>
        members[int(i)][rest] = v
    return members


def soup_state(adapters: Sequence[dict[str, torch.Tensor]], heads: Sequence[dict[str, torch.Tensor]],
               ensemble: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The soup's adapter and head state dicts (see the module docstring)."""
    n = len(adapters)
    keys = sorted(adapters[0])
    for a in adapters[1:]:
        if sorted(a) != keys:
            raise ConfigError("the checkpoints' adapters hold different modules; they are not fine-tunes of one "
                              "config")
    adapter: dict[str, torch.Tensor] = {}
    for k in keys:
        if ".lora_A." in k:
            adapter[k] = torch.cat([a[k] for a in adapters], dim=0).contiguous()  # (N r, in)
        elif ".lora_B." in k:
            adapter[k] = (torch.cat([a[k] for a in adapters], dim=1) / n).contiguous()  # (out, N r)
        else:
            raise ConfigError(f"cannot soup adapter tensor {k!r}: only LoRA A/B matrices are supported "
                              "(no bias, no DoRA magnitude)")
    head: dict[str, torch.Tensor] = {}
    j = 0
    for h in heads:
        for member in _head_members(h, ensemble):
            for name, v in member.items():
                head[f"heads.{j}.{name}"] = v.clone().contiguous()
            j += 1
    return adapter, head


def soup_checkpoints(paths: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Write the soup of the checkpoints at ``paths`` to ``out`` (atomically); refuse differing configs."""
    if len(paths) < 2:
        raise ConfigError(f"a soup needs at least two checkpoints, got {len(paths)}")
    ckpts = [load_checkpoint(p, trainer_state=False) for p in paths]
    names = [str(p) for p in paths]
    diffs = config_differences([c.config for c in ckpts], names)
    if diffs:
        raise ConfigError("cannot soup checkpoints whose configs differ (only "
                          f"{', '.join(sorted(SOUP_FREE_KEYS))} may differ):\n  " + "\n  ".join(diffs))
    cfg = dict(ckpts[0].config)
    n = len(ckpts)
    ensemble = int(cfg.get("head_ensemble", 1))
    adapter, head = soup_state([c.adapter for c in ckpts], [c.head for c in ckpts], ensemble)
    if cfg.get("use_lora", True):
        cfg["lora_r"] = int(cfg["lora_r"]) * n
        cfg["lora_alpha"] = int(cfg["lora_alpha"]) * n
    cfg["head_ensemble"] = ensemble * n
    cfg["soup_of"] = names
    save_checkpoint(out, config=cfg, adapter=adapter, head=head)  # temperatures: reset to 1
    return Path(out)
