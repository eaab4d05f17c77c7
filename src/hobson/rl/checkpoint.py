"""Per-update checkpoints of an RL run, and the state they restore.

``<output>/checkpoints/update-{k:06d}/`` holds ``actor.safetensors``, ``critic.safetensors``
(except GRPO) and ``state.pt``: optimizer, scheduler and loss-scaler state of each model, the RNG
states (python, numpy, torch CPU, every CUDA device), the data cursor, the publication version
and digest, and the update number. The directory is written under a temporary name and renamed,
so a checkpoint either exists whole or not at all. Resuming restores all of it; the RNG states
are restored last, just before the first rollout, so nothing that runs at start-up can shift them.

When publication ``v{k}`` holds exactly the actor's state dict (same names, dtypes and bytes: the
run checks the digests once), the checkpoint does not write the actor again: ``state.pt`` names
the publication (``actor_publication``) and loading reads it, digest-checked. The actor is the
largest file after the fp32 masters (Huginn fp16: 7 GB of 21 GB; Nanbeige fp32: 17 GB of 31 GB),
and checkpoint writes are bound by the disk.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hobson.errors import StageError

_NAME = re.compile(r"^update-(\d{6})$")


def checkpoint_dir(output: str | os.PathLike, update: int) -> Path:
    return Path(output) / "checkpoints" / f"update-{update:06d}"


def list_checkpoints(output: str | os.PathLike) -> list[int]:
    root = Path(output) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / "state.pt").exists())


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, shared storage (tied weights) written once per name."""
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in module.state_dict().items()}


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save without the CRC-32 of every record: on a 2 GB state it wrote 0.9 GB/s with and
    1.6 GB/s without (bench/checkpoint.py), and the fp32 masters make a Huginn state 14 GB. The
    checkpoint is fsynced and renamed into place whole, so the CRC guards little here."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def save_checkpoint(
    output: str | os.PathLike,
    update: int,
    *,
    actor: nn.Module,
    critic: nn.Module | None,
    state: dict[str, Any],
    actor_publication: str | None = None,
) -> Path:
    """Write the checkpoint of ``update``; ``state`` is everything but the weights (see module doc).

    ``actor_publication``: the publication directory, relative to ``output``, that holds the
    actor's exact state dict with digest ``state["digest"]``; the actor is then not written again.
    """
    final = checkpoint_dir(output, update)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        if actor_publication is None:
            save_file(module_tensors(actor), str(tmp / "actor.safetensors"))
        else:
            state = {**state, "actor_publication": actor_publication}
        if critic is not None:
            save_file(module_tensors(critic), str(tmp / "critic.safetensors"))
        with _without_crc32():
            torch.save({**state, "update": update, "rng": rng_state()}, tmp / "state.pt")
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune_checkpoints(output: str | os.PathLike, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` whole checkpoints (0: keep all); returns the updates removed."""
    if keep <= 0:
        return []
    gone = list_checkpoints(output)[:-keep]
    for update in gone:
        shutil.rmtree(checkpoint_dir(output, update))
    return gone


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """``{"actor": tensors, "critic": tensors | None, **state}`` of one checkpoint directory."""
    path = Path(path)
    if not (path / "state.pt").exists():
        raise StageError(f"{path}: not a checkpoint (no state.pt)")
    out = torch.load(path / "state.pt", weights_only=False)
    if "actor_publication" in out:
        from hobson.rl.publication import read_verified

        pub = path.parent.parent / out["actor_publication"]
        if not any((pub / f).exists() for f in ("model.safetensors", "model.safetensors.index.json")):
            raise StageError(f"{path}: its actor weights are publication {pub}, whose weights are missing")
        _, digest, out["actor"] = read_verified(pub)  # refuses bytes that differ from the manifest
        if digest != out["digest"]:
            raise StageError(f"{path}: publication {pub} has digest {digest}, the checkpoint recorded {out['digest']}")
    else:
        out["actor"] = load_file(str(path / "actor.safetensors"))
    critic = path / "critic.safetensors"
    out["critic"] = load_file(str(critic)) if critic.exists() else None
    return out


def load_weights(module: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy checkpoint tensors into ``module`` bit for bit (names and shapes must match)."""
    own = module.state_dict()
    if set(own) != set(tensors):
        raise StageError(
            f"{where}: names differ from the model: missing {sorted(set(own) - set(tensors))[:5]}, "
            f"unexpected {sorted(set(tensors) - set(own))[:5]}"
        )
    with torch.no_grad():
        for name, t in own.items():
            if t.shape != tensors[name].shape or t.dtype != tensors[name].dtype:
                raise StageError(
                    f"{where}: {name} is {tensors[name].dtype}{list(tensors[name].shape)}, "
                    f"the model has {t.dtype}{list(t.shape)}"
                )
            t.copy_(tensors[name])


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """None if ``a`` and ``b`` are equal bit for bit (tensors, arrays, containers), else where they differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        ua, ub = a.contiguous().view(torch.uint8).flatten(), b.contiguous().view(torch.uint8).flatten()
        if torch.equal(ua, ub):
            return None
        fa, fb = a.flatten(), b.flatten()
        idx = (
            int(
                (fa.view(torch.uint8).view(-1, a.element_size()) != fb.view(torch.uint8).view(-1, b.element_size()))
                .any(dim=1)
                .nonzero()[0]
            )
            if a.numel()
            else 0
        )
        return f"{path}[{idx}]: {fa[idx].item()!r} vs {fb[idx].item()!r}"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return first_difference(torch.from_numpy(np.asarray(a).copy()), torch.from_numpy(np.asarray(b).copy()), path)
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} in only one"
        for k in sorted(a, key=str):
            d = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if type(a) is not type(b) or a != b:
        if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
            return None  # NaN == NaN for our purposes (same bits is what matters and both are NaN)
        return f"{path}: {a!r} vs {b!r}"
    return None
