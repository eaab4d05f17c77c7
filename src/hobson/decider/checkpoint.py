"""Decider checkpoints: self-describing directories, written atomically.

A checkpoint directory holds::

    config.json          the training config (sorted keys) that produced it
    adapter.safetensors  the LoRA weights (peft state-dict names; empty when use_lora is false)
    head.safetensors     the readout head
    temperatures.json    calibration temperatures ({"global": 1.0, "per_kind": {}} until calibrated)
    trainer_state.pt     (training checkpoints) step, sampler cursor, collator RNG, optimizer,
                         scheduler and every rank's RNG states
    manifest.json        every other file's SHA-256 and size (``hobson.manifest``), written last

It is built in a temp directory beside its final name and renamed into place, so a reader sees
either no checkpoint or a complete one, and every load verifies its bytes against the manifest
(trained, souped and calibrated checkpoints alike). A checkpoint from before manifests (no
``manifest.json``) loads with a warning. Training checkpoints live in
``<output_dir>/checkpoints/step_XXXXXXXX``; a restart resumes from the newest one that verifies
(:func:`newest_intact_checkpoint`), setting corrupt ones aside as ``*.corrupt``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hobson import manifest
from hobson.errors import DataError
from hobson.io import atomic_dir, disk_full_is_an_error

CONFIG, ADAPTER, HEAD, TEMPERATURES, TRAINER_STATE = (
    "config.json", "adapter.safetensors", "head.safetensors", "temperatures.json", "trainer_state.pt")
DEFAULT_TEMPERATURES = {"global": 1.0, "per_kind": {}}
# trainer_state.pt's "format": 2 since checkpoints carry a manifest (absent: written before, loaded
# with a warning); a training checkpoint of this format without its manifest is incomplete
FORMAT = 2
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
    need = sum(t.numel() * t.element_size() for part in (adapter, head) for t in part.values())
    with disk_full_is_an_error(path, need), atomic_dir(path) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(tmp / ADAPTER))
        save_file({k: v.detach().cpu().contiguous() for k, v in head.items()}, str(tmp / HEAD))
        temps = DEFAULT_TEMPERATURES if temperatures is None else temperatures
        (tmp / TEMPERATURES).write_text(json.dumps(temps, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if trainer_state is not None:
            torch.save({**trainer_state, "format": FORMAT}, tmp / TRAINER_STATE)
        files = manifest.write(tmp, kind="decider-checkpoint", format=FORMAT)
    return {name: manifest.digest(f) for name, f in files.items()}


_warned_unverified: set[Path] = set()


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check every file of decider checkpoint ``path`` against its manifest; raises
    :class:`hobson.manifest.ManifestMismatch` naming the file and why. One from before manifests
    is recognised by its files (config, adapter, head, no manifest) and passes with a warning."""
    path = Path(path)
    missing = [n for n in (CONFIG, ADAPTER, HEAD) if not (path / n).is_file()]
    found = manifest.read(path) if path.is_dir() else None
    if missing:
        if found is not None:  # a checkpoint with a manifest that lost a file: corrupt, not foreign
            raise manifest.ManifestMismatch(f"{path / missing[0]}: missing (the manifest lists it)")
        raise DataError(f"{path}: not a decider checkpoint (missing {', '.join(missing)}); pass a directory "
                        "hobson wrote (a training run's final/ or checkpoints/step_*, a soup, a calibrated one)")
    if found is None:
        if (path / TRAINER_STATE).is_file():
            try:
                fmt = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False).get("format")
            except Exception as e:  # noqa: BLE001 (any unreadable pickle is a corrupt file)
                raise manifest.ManifestMismatch(f"{path / TRAINER_STATE}: unreadable ({type(e).__name__})") from None
            if fmt is not None:
                raise manifest.ManifestMismatch(f"{path}: incomplete, no {manifest.MANIFEST} (it is written last)")
        if path not in _warned_unverified:
            _warned_unverified.add(path)
            print(f"[hobson] warning: {path} was written before checkpoints had manifests; loaded without "
                  "verifying its bytes", file=sys.stderr, flush=True)
        return
    manifest.verify(path, found)


def load_checkpoint(path: str | os.PathLike, *, trainer_state: bool = True) -> Checkpoint:
    """The checkpoint at ``path``, its bytes verified first (:func:`verify_checkpoint`)."""
    path = Path(path)
    verify_checkpoint(path)
    config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    temps_file = path / TEMPERATURES
    temps = json.loads(temps_file.read_text(encoding="utf-8")) if temps_file.is_file() else dict(DEFAULT_TEMPERATURES)
    state = None
    if trainer_state and (path / TRAINER_STATE).is_file():
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    return Checkpoint(path, config, load_file(str(path / ADAPTER)), load_file(str(path / HEAD)), temps, state)


def newest_intact_checkpoint(root: str | os.PathLike, log: Any = print) -> tuple[Path | None, list[dict]]:
    """``(newest step checkpoint under root whose bytes verify, set-aside events)``.

    A corrupt or incomplete one is renamed ``*.corrupt`` (kept for inspection), ``log`` gets an
    event naming the file and why, and the next older one is tried; a resume is exact, so the run
    still ends with the uninterrupted result. Checkpoints were there but none verifies: an error.
    """
    events: list[dict] = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
            return path, events
        except (manifest.ManifestMismatch, DataError) as e:  # corrupt, or a part of it missing
            aside = manifest.set_aside(path)
            event = {"corrupt_checkpoint": str(path), "reason": str(e), "kept_as": str(aside)}
            events.append(event)
            log(event)
    if events:
        raise DataError(f"no intact checkpoint left in {root} to resume from (set aside: "
                        f"{', '.join(Path(e['kept_as']).name for e in events)}); start again in a new output_dir, "
                        "or keep more checkpoints (keep_checkpoints)")
    return None, events


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete step checkpoints under ``root``, oldest first (temp directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    # a manifest makes it a checkpoint even if a file went missing (verify then says which)
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)
             and ((p / TRAINER_STATE).is_file() or (p / manifest.MANIFEST).is_file())]
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
