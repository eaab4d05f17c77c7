"""Per-update checkpoints of an RL run, and the state they restore.

``<output>/checkpoints/update-{k:06d}/`` holds ``actor.safetensors``, ``critic.safetensors``
(except GRPO) and ``state.pt``: optimizer, scheduler and loss-scaler state of each model, the RNG
states (python, numpy, torch CPU, every CUDA device), the data cursor, the publication version
and digest, and the update number. Since format 3 the tensors of that state (the fp32 masters and
Adam moments: most of the bytes) are in ``state.safetensors``, named by their place in the state,
and ``state.pt`` holds the rest with a :class:`TensorRef` where each was; every file is written
by :func:`hobson.tensorfile.save`'s threads rather than through one pickle stream. The directory
is written under a temporary name and renamed, so a checkpoint either exists whole or not at all.
Resuming restores all of it; the RNG states are restored last, just before the first rollout, so
nothing that runs at start-up can shift them.

When publication ``v{k}`` holds exactly the actor's state dict (same names, dtypes and bytes: the
run checks the digests once), the checkpoint does not write the actor again: ``state.pt`` names
the publication (``actor_publication``) and loading reads it, digest-checked. The actor is the
largest file after the fp32 masters (Huginn fp16: 7 GB of 21 GB; Nanbeige fp32: 17 GB of 31 GB),
and checkpoint writes are bound by the disk.

A checkpoint is taken in two parts: :func:`capture` copies what it holds (tensors cloned on their
own device, the RNG states read) so that no later step can change it, and :func:`write` puts the
copy on disk. :class:`CheckpointWriter` runs the write in a background thread while the next
update rolls out and trains: on two H200s a Huginn checkpoint (36 GB) took 34-44 s to write, more
than the rest of an update. :func:`save_checkpoint` does both parts at once.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from hobson import bytepool, manifest, rng, tensorfile
from hobson.errors import HobsonError, StageError
from hobson.io import atomic_dir, disk_full_is_an_error

_NAME = re.compile(r"^update-(\d{6})$")
# state.pt's "format": 2 since checkpoints carry a manifest; none: written before (loaded with a
# warning); 3 since the state's tensors are in state.safetensors (2 still loads)
FORMAT = 3
STATE_TENSORS = "state.safetensors"
MANIFEST = manifest.MANIFEST
CheckpointCorrupt = manifest.ManifestMismatch  # the RL loop's name for it
set_aside = manifest.set_aside


def checkpoint_dir(output: str | os.PathLike, update: int) -> Path:
    return Path(output) / "checkpoints" / f"update-{update:06d}"


def list_checkpoints(output: str | os.PathLike) -> list[int]:
    root = Path(output) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / "state.pt").exists())


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


@dataclass
class Snapshot:
    """What one checkpoint holds. ``owned``: its tensors are private copies (from :func:`capture`)."""

    actor: dict[str, torch.Tensor] | None  # None: the actor is the publication the state names
    critic: dict[str, torch.Tensor] | None
    state: dict[str, Any]
    owned: bool = False


def _copy_tree(obj: Any) -> Any:
    """``obj`` with every tensor cloned on its own device and every container rebuilt: the
    optimizer state dicts hold live tensors and lists that the next step changes in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, _copy_tree(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_copy_tree(v) for v in obj)
    return copy.deepcopy(obj)


def _weights(module: nn.Module, clone: bool) -> dict[str, torch.Tensor]:
    # one tensor per name: safetensors refuses tensors that share storage (tied weights)
    return {k: (v.detach().clone() if clone else v.detach()) for k, v in module.state_dict().items()}


def _snapshot(
    update: int,
    actor: nn.Module,
    critic: nn.Module | None,
    state: dict[str, Any],
    actor_publication: str | None,
    owned: bool,
) -> Snapshot:
    full = {**state, "update": update, "rng": rng.capture()}
    if actor_publication is not None:
        full["actor_publication"] = actor_publication
    return Snapshot(
        actor=None if actor_publication is not None else _weights(actor, clone=owned),
        critic=_weights(critic, clone=owned) if critic is not None else None,
        state=_copy_tree(full) if owned else full,
        owned=owned,
    )


def capture(
    update: int,
    *,
    actor: nn.Module,
    critic: nn.Module | None,
    state: dict[str, Any],
    actor_publication: str | None = None,
) -> Snapshot:
    """A private copy of checkpoint ``update``, taken now (the RNG states too); see :func:`write`.

    The tensors stay on their devices: cloning on the GPU takes milliseconds, and the background
    write moves them to the host. Raises ``torch.OutOfMemoryError`` where the copy does not fit.
    """
    snap = _snapshot(update, actor, critic, state, actor_publication, owned=True)
    # the clones are queued on this thread's stream; the writer thread copies them to the host on
    # its own, so they must be done first
    for device in _cuda_devices([snap.actor, snap.critic, snap.state]):
        torch.cuda.synchronize(device)
    return snap


def _cuda_devices(obj: Any) -> set[torch.device]:
    if isinstance(obj, torch.Tensor):
        return {obj.device} if obj.is_cuda else set()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return set().union(*(_cuda_devices(v) for v in obj)) if obj else set()
    return set()


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor of the state was: its name in ``state.safetensors`` and the device it goes back to."""

    name: str
    device: str
    requires_grad: bool = False  # DeepSpeed's fp32 master groups require grad; they come back so
    parameter: bool = False


def split_tensors(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` with each tensor (in dicts, lists and tuples) replaced by a :class:`TensorRef`, and
    the tensors by name (their path in ``obj``). The same tensor object twice is stored once.
    Tensors safetensors cannot hold (other dtypes, subclasses other than Parameter) stay."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, TensorRef] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, nn.Parameter) or x.dtype not in tensorfile.DTYPES:
                return x
            if id(x) not in seen:
                name = path or "tensor"
                while name in tensors:
                    name += "'"
                tensors[name] = x
                seen[id(x)] = TensorRef(name, str(x.device), x.requires_grad, type(x) is nn.Parameter)
            return seen[id(x)]
        if type(x) in (dict, collections.OrderedDict):
            return type(x)((k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in x.items())
        if type(x) in (list, tuple):
            return type(x)(walk(v, f"{path}[{i}]") for i, v in enumerate(x))
        return x

    return walk(obj, ""), tensors


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`: each :class:`TensorRef` replaced by its tensor, on its device."""
    placed: dict[str, torch.Tensor] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, TensorRef):
            if x.name not in placed:
                if x.name not in tensors:
                    raise CheckpointCorrupt(f"{STATE_TENSORS} has no tensor {x.name!r}, which state.pt refers to")
                t = tensors[x.name]
                t = t if x.device == "cpu" else t.to(x.device)
                placed[x.name] = nn.Parameter(t, x.requires_grad) if x.parameter else t.requires_grad_(x.requires_grad)
            return placed[x.name]
        if type(x) in (dict, collections.OrderedDict):
            return type(x)((k, walk(v)) for k, v in x.items())
        if type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


def write(output: str | os.PathLike, update: int, snap: Snapshot) -> Path:
    """Write ``snap`` as checkpoint ``update``: a temporary directory, fsynced, then renamed.

    The tensors go from where they are (a private GPU copy, or CPU memory) straight to their
    files through :func:`hobson.tensorfile.save`; in-line (``snap.owned`` false) nothing else
    runs meanwhile, so live tensors are written as they are.
    """
    final = checkpoint_dir(output, update)
    state, state_tensors = split_tensors({**snap.state, "format": FORMAT})
    need = sum(tensorfile.nbytes(part) for part in (snap.actor, snap.critic, state_tensors) if part)
    with disk_full_is_an_error(final, need or None), atomic_dir(final) as tmp:
        if snap.actor is not None:
            tensorfile.save(snap.actor, tmp / "actor.safetensors")
        if snap.critic is not None:
            tensorfile.save(snap.critic, tmp / "critic.safetensors")
        tensorfile.save(state_tensors, tmp / STATE_TENSORS)
        with _without_crc32():
            torch.save(state, tmp / "state.pt")
        manifest.write(tmp, format=FORMAT, update=update)  # hashed from the page cache; what a resume verifies
    return final


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Check every file of checkpoint ``path`` against its manifest; returns warnings (a checkpoint
    from before manifests); raises :class:`CheckpointCorrupt` naming the file and why."""
    path = Path(path)
    if not (path / "state.pt").is_file():
        raise CheckpointCorrupt(f"{path}: incomplete, no state.pt")
    found = manifest.read(path)
    if found is None:
        try:
            fmt = torch.load(path / "state.pt", weights_only=False, map_location="cpu").get("format")
        except Exception as e:  # noqa: BLE001 (any unreadable pickle is a corrupt file)
            raise CheckpointCorrupt(f"{path / 'state.pt'}: unreadable ({type(e).__name__}: {e})") from None
        if fmt is not None:
            raise CheckpointCorrupt(f"{path}: incomplete, no {manifest.MANIFEST} (it is written last)")
        return [f"{path}: written before checkpoints had manifests; loaded without verifying its bytes"]
    manifest.verify(path, found)
    return []


def save_checkpoint(
    output: str | os.PathLike,
    update: int,
    *,
    actor: nn.Module,
    critic: nn.Module | None,
    state: dict[str, Any],
    actor_publication: str | None = None,
) -> Path:
    """Write the checkpoint of ``update`` now; ``state`` is everything but the weights (see module doc).

    ``actor_publication``: the publication directory, relative to ``output``, that holds the
    actor's exact state dict with digest ``state["digest"]``; the actor is then not written again.
    """
    return write(output, update, _snapshot(update, actor, critic, state, actor_publication, owned=False))


class CheckpointWriter:
    """Writes one checkpoint at a time in a background thread.

    :meth:`submit` waits for the previous write first, so at most one copy is held. A failed write
    raises from the next :meth:`submit` or :meth:`wait`, naming the update; its temporary
    directory is gone by then. The thread is not a daemon: an interpreter that exits waits for it.
    """

    def __init__(self, output: str | os.PathLike) -> None:
        self.output = Path(output)
        self.pending: int | None = None  # the update being written
        self._thread: threading.Thread | None = None
        self._result: tuple[Path, float] | BaseException | None = None

    def submit(self, update: int, snap: Snapshot) -> tuple[int, Path, float] | None:
        """Start writing ``snap``; returns what :meth:`wait` returned for the previous write."""
        previous = self.wait()

        def work() -> None:
            t0 = time.perf_counter()
            try:
                with bytepool.background():  # never ahead of the next update's publication
                    self._result = (write(self.output, update, snap), time.perf_counter() - t0)
            except BaseException as e:  # handed to the main thread by wait()
                self._result = e

        self.pending, self._result = update, None
        self._thread = threading.Thread(target=work, name=f"checkpoint-{update:06d}")
        self._thread.start()
        return previous

    def wait(self) -> tuple[int, Path, float] | None:
        """Block until the write in flight is done: ``(update, path, write seconds)``, or None if none was."""
        if self._thread is None:
            return None
        self._thread.join()
        update, result = self.pending, self._result
        self._thread, self.pending, self._result = None, None, None
        if isinstance(result, BaseException):
            why = str(result) if isinstance(result, HobsonError) else repr(result)
            raise StageError(f"checkpoint of update {update} failed: {why}") from result
        assert update is not None and result is not None
        return update, result[0], result[1]


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
    for warning in verify_checkpoint(path):
        print(f"rl: warning: {warning}", flush=True)
    out = torch.load(path / "state.pt", weights_only=False)
    if out.pop("format", None) == 3 or (path / STATE_TENSORS).exists():
        if not (path / STATE_TENSORS).is_file():
            raise CheckpointCorrupt(f"{path / STATE_TENSORS}: missing (a format-3 state.pt keeps its tensors there)")
        out = join_tensors(out, load_file(str(path / STATE_TENSORS)))
    if "actor_publication" in out:
        from hobson.rollout.publication import read_verified

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
        ua, ub = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
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
