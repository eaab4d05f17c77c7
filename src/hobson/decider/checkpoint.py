"""Decider checkpoints: self-describing directories, written atomically.

A checkpoint directory holds::

    config.json          the training config (sorted keys) that produced it
    adapter.safetensors  the LoRA weights (peft state-dict names; empty when use_lora is false)
    head.safetensors     the readout head
    temperatures.json    calibration temperatures ({"global": 1.0, "per_kind": {}} until calibrated)
    trainer_state.pt     (training checkpoints) step, sampler cursor, collator RNG, optimizer,
                         scheduler and every rank's RNG states

It is built in a temp directory beside its final name and renamed into place, so a reader sees
either no checkpoint or a complete one. Training checkpoints live in
``<output_dir>/checkpoints/step_XXXXXXXX``; the newest complete one is what a restart resumes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hobson.errors import DataError
from hobson.io import atomic_dir, sha256_file

CONFIG, ADAPTER, HEAD, TEMPERATURES, TRAINER_STATE = (
    "config.json", "adapter.safetensors", "head.safetensors", "temperatures.json", "trainer_state.pt")
DEFAULT_TEMPERATURES = {"global": 1.0, "per_kind": {}}
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    head: dict[str, torch.Tensor]
    temperatures: dict[str, Any]
    trainer_state: dict[str, Any] | None


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def save_checkpoint(path: str | os.PathLike, *, config: dict[str, Any], adapter: dict[str, torch.Tensor],
                    head: dict[str, torch.Tensor], temperatures: dict[str, Any] | None = None,
                    trainer_state: dict[str, Any] | None = None) -> dict[str, str]:
    """Write the directory ``path`` atomically (replacing an old one); return ``{file: sha256}``."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(tmp / ADAPTER))
        save_file({k: v.detach().cpu().contiguous() for k, v in head.items()}, str(tmp / HEAD))
        temps = DEFAULT_TEMPERATURES if temperatures is None else temperatures
        (tmp / TEMPERATURES).write_text(json.dumps(temps, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER_STATE)
        digests = {f.name: sha256_file(f) for f in sorted(tmp.iterdir())}
    return digests


def load_checkpoint(path: str | os.PathLike, *, trainer_state: bool = True) -> Checkpoint:
    path = Path(path)
    missing = [n for n in (CONFIG, ADAPTER, HEAD) if not (path / n).is_file()]
    if missing:
        raise DataError(f"{path}: not a decider checkpoint (missing {', '.join(missing)})")
    config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    temps_file = path / TEMPERATURES
    temps = json.loads(temps_file.read_text(encoding="utf-8")) if temps_file.is_file() else dict(DEFAULT_TEMPERATURES)
    state = None
    if trainer_state and (path / TRAINER_STATE).is_file():
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    return Checkpoint(path, config, load_file(str(path / ADAPTER)), load_file(str(path / HEAD)), temps, state)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete step checkpoints under ``root``, oldest first (temp directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the ``keep`` newest step checkpoints (``keep == 0`` keeps all)."""
    if keep <= 0:
        return
    for p in list_checkpoints(root)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
