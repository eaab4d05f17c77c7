"""Versioned policy publications: how the trainer hands weights to the rollout engine.

Layout: ``<output>/publications/v{N:06d}/`` holding the provider's export (``config.json``,
``model.safetensors`` or shards) with ``model.safetensors.index.json`` always present, and
``manifest.json``::

    {"version": N, "digest": "<sha256>", "model_revision": ..., "engine_revision": ...,
     "dtype": "float32", "model_type": ..., "files": {name: {"bytes": n}}}

The digest is SHA-256 over every tensor in name order: name, dtype, shape, then a 16-byte hash
of each 64 MiB piece of its raw bytes computed on the tensor's device (:func:`tensors_digest`:
the same bits on a GPU and on the CPU, so weights are hashed where they are); the engine
recomputes it from the bytes it read, loads exactly those tensors, and refuses a mismatch. A
version is written to a temporary sibling and renamed into place, so a reader never sees half a
publication. Versions increase by one; publishing a version that already exists (a resumed run
republishing its restored weights) is allowed only if the digest is the same.
Critics are refused (``Provider.export``): a critic never appears in a publication.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hobson.errors import DigestMismatch, HobsonError
from hobson.io import disk_full_is_an_error, fsync_files, write_json_atomic
from hobson.models.common import DTYPE_NAMES, INDEX_FILE, SINGLE_FILE, SafetensorsDir, write_checkpoint

MANIFEST = "manifest.json"


class PublicationError(HobsonError):
    """A publication is missing, inconsistent or may not be loaded now."""


def version_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


DIGEST_CHUNK = 64 * 1024**2  # bytes per piece of the digest
_MULTIPLIERS: dict[str, Any] = {}  # "numpy" or a device -> (2, words) int32, grown on demand


def _multipliers_np(words: int) -> Any:
    """Two rows of odd 32-bit multipliers, from a splitmix64 of the word index (numpy's uint64
    arithmetic wraps by definition: the same table everywhere)."""
    import numpy as np

    m = _MULTIPLIERS.get("numpy")
    if m is None or m.shape[1] < words:
        n = max(words, 1 << 16)
        with np.errstate(over="ignore"):
            x = np.arange(1, 2 * n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
        m = (x.astype(np.uint32) | np.uint32(1)).view(np.int32).reshape(n, 2).T.copy()
        _MULTIPLIERS["numpy"] = m
    return m[:, :words]


def _piece_sums_np(piece: Any) -> list[int]:
    import numpy as np

    w = piece.view(np.int32)
    m = _multipliers_np(w.size)
    out = np.empty_like(w)
    sums = []
    for k in range(2):
        np.multiply(w, m[k], out=out)  # int32 products wrap mod 2**32 (numpy's defined behaviour)
        sums.append(int(out.sum(dtype=np.int64)))  # exact: 2**24 terms below 2**31 each
    return sums


def _piece_sums_torch(piece: Tensor) -> Tensor:
    """The same two sums on ``piece``'s device: the int32 products wrap as numpy's do (two's
    complement, what every CPU and GPU integer multiply gives), and the sum accumulates them in
    int64 (exact: 2**24 terms below 2**31 each). One product buffer and one reduction per piece,
    not an int64 copy of every word: the digest reads its bytes about once, which is what makes
    it cheap next to the copy it checks."""
    key = str(piece.device)
    words = piece.numel() // 4
    m = _MULTIPLIERS.get(key)
    if m is None or m.shape[1] < words:
        m = torch.from_numpy(_multipliers_np(max(words, 1 << 16))).to(piece.device)
        _MULTIPLIERS[key] = m
    return (piece.view(torch.int32) * m[:, :words]).sum(dim=1, dtype=torch.int64)


def _device_sums(split: dict[str, tuple[Tensor, list[tuple[int, int]]]], names: list[str]) -> dict[str, list[int]]:
    """The piece sums of ``names`` on their own devices, read back in one transfer at the end
    (a ``.tolist()`` per tensor would wait for the device hundreds of times per version)."""
    parts = [(n, torch.stack([_piece_sums_torch(split[n][0][a:b]) for a, b in split[n][1]]).reshape(-1))
             for n in names if split[n][1]]
    out: dict[str, list[int]] = {}
    by_device: dict[Any, list[tuple[str, Tensor]]] = {}
    for n, s in parts:
        by_device.setdefault(s.device, []).append((n, s))
    for group in by_device.values():
        flat = torch.cat([s for _, s in group]).tolist()
        i = 0
        for n, s in group:
            out[n] = flat[i:i + s.numel()]
            i += s.numel()
    return out


def _pieces(t: Tensor) -> tuple[Tensor, list[tuple[int, int]]]:
    """``t``'s bytes, flat (a last piece that is not whole 32-bit words zero-padded; the length is
    hashed too), and the ``(start, end)`` of each ``DIGEST_CHUNK``-byte piece."""
    t = t.detach()
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8,
                                                                                       device=t.device)
    n = flat.numel()
    if n % 4:
        flat = torch.cat([flat, flat.new_zeros(4 - n % 4)])
    return flat, [(i, min(i + DIGEST_CHUNK, flat.numel())) for i in range(0, flat.numel(), DIGEST_CHUNK)]


def tensors_digest(tensors: dict[str, Tensor], workers: int | None = None) -> str:
    """The version digest: SHA-256 over the tensors in name order, of ``name\0dtype\0shape\0bytes\0``
    then, for each ``DIGEST_CHUNK``-byte piece of the raw bytes, two 64-bit sums over its 32-bit
    words ``w_j`` of ``int32(w_j * M_k[j])`` (products wrapped to 32 bits, fixed odd multipliers).

    Integer sums are exact and commute, so the value does not depend on where it is computed or
    how a reduction is split: the trainer's tensors on a GPU are hashed there (no copy through
    the host), a publication read from disk on the CPU (numpy, the pieces on every core), the
    buckets an engine received on its device, all to the same bits. Any change of one word
    changes the sums (odd multipliers); they catch damage, not a forger (the per-job secret keeps
    others off the channel).
    """
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(tensors)
    split = {n: _pieces(tensors[n]) for n in names}
    sums: dict[str, list[int]] = {}
    cpu = [(n, a, b) for n in names if split[n][0].device.type == "cpu" for a, b in split[n][1]]
    if cpu:
        with ThreadPoolExecutor(max_workers=workers or min(32, os.cpu_count() or 1)) as pool:
            got = list(pool.map(lambda x: _piece_sums_np(split[x[0]][0][x[1]:x[2]].numpy()), cpu))
        for (n, _, _), s in zip(cpu, got, strict=True):
            sums.setdefault(n, []).extend(s)
    with torch.no_grad():
        sums.update(_device_sums(split, [n for n in names if split[n][0].device.type != "cpu"]))
    h = hashlib.sha256()
    for n in names:
        t = tensors[n]
        h.update(f"{n}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0{t.numel() * t.element_size()}\0"
                 .encode())
        for v in sums.get(n, []):
            h.update(v.to_bytes(8, "little", signed=True))
    return h.hexdigest()


def read_tensors(pub_dir: str | os.PathLike) -> dict[str, Tensor]:
    ckpt = SafetensorsDir(pub_dir)
    return {name: ckpt.get(name) for name in ckpt.names()}


@dataclass(frozen=True)
class Manifest:
    version: int
    digest: str
    model_revision: str
    engine_revision: str
    dtype: str
    model_type: str
    files: dict[str, Any]

    @classmethod
    def read(cls, pub_dir: str | os.PathLike) -> Manifest:
        path = Path(pub_dir) / MANIFEST
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PublicationError(f"{path}: missing (not a publication, or not committed yet)") from None
        except json.JSONDecodeError as e:
            raise PublicationError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__})
        except KeyError as e:
            raise PublicationError(f"{path}: lacks {e.args[0]!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Staged:
    """A version in memory: what :func:`publish` would write, before (or instead of) the disk.

    ``manifest.files`` is empty: no file holds these bytes. The digest is the same function of the
    same tensors as a written publication's, so a version's digest does not depend on how it
    travelled (``tests/rl/test_weight_transport.py`` checks both providers)."""

    manifest: Manifest
    config: dict[str, Any]
    tensors: dict[str, Tensor]


def stage(
    provider: Any,
    actor: nn.Module,
    version: int,
    *,
    model_revision: str,
    engine_revision: str,
    dtype: torch.dtype,
) -> Staged:
    """Version ``version`` of ``actor`` as tensors, config and manifest, with no file written. The
    tensors stay on the actor's device (a GPU's are digested and sent from there, never through
    the host); a tensor already in ``dtype`` is the live parameter itself, so the receiver copies."""
    tensors, config = provider.export_state(actor, dtype=dtype, device=None)
    manifest = Manifest(
        version=version,
        digest=tensors_digest(tensors),
        model_revision=model_revision,
        engine_revision=engine_revision,
        dtype=DTYPE_NAMES[dtype],
        model_type=actor.config.to_dict()["model_type"],
        files={},
    )
    return Staged(manifest, config, tensors)


def publish(
    provider: Any,
    actor: nn.Module,
    root: str | os.PathLike,
    version: int,
    *,
    model_revision: str,
    engine_revision: str,
    dtype: torch.dtype,
) -> Manifest:
    """Export ``actor`` as version ``version`` under ``root``; return its manifest.

    Refuses a version that is not the next one (the highest existing + 1), except an existing
    version whose digest equals the new one (the republish after a resume), which is kept as is.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    existing = sorted(int(p.name[1:]) for p in root.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit())
    need = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
               for t in actor.state_dict().values())
    with disk_full_is_an_error(final, need), tempfile.TemporaryDirectory(prefix=f".v{version:06d}.",
                                                                         dir=root) as tmp_root:
        tmp = Path(tmp_root) / "pub"
        # the tensors stay where they are: digested there (on a GPU, by the GPU) and written from
        # there through pinned staging (hobson.tensorfile), never copied to the host whole. The
        # engine that loads the files digests the bytes it reads and refuses any that differ.
        tensors, config = provider.export_state(actor, dtype=dtype, device=None)
        digest = tensors_digest(tensors)
        write_checkpoint(tmp, tensors, config)
        del tensors
        if not (tmp / INDEX_FILE).exists():
            # single-file exports get an index too, so every publication reads the same way
            names = SafetensorsDir(tmp).names()
            with open(tmp / INDEX_FILE, "w", encoding="utf-8") as f:
                json.dump(
                    {"metadata": {}, "weight_map": dict.fromkeys(names, SINGLE_FILE)}, f, indent=2, sort_keys=True
                )
                f.write("\n")
        # the digest covers every tensor byte; whole-file hashes would only hash the same bytes again
        files = {p.name: {"bytes": p.stat().st_size} for p in sorted(tmp.iterdir())}
        manifest = Manifest(
            version=version,
            digest=digest,
            model_revision=model_revision,
            engine_revision=engine_revision,
            dtype=DTYPE_NAMES[dtype],
            model_type=actor.config.to_dict()["model_type"],
            files=files,
        )
        if final.exists():
            old = Manifest.read(final)
            if old.digest != digest:
                raise DigestMismatch(
                    f"{final}: version {version} exists with digest {old.digest}; the weights now give {digest} "
                    "(a resumed run must republish exactly what it checkpointed)"
                )
            if (final / INDEX_FILE).exists():
                try:  # a resume's republish: the bytes on disk must still be the recorded ones
                    intact = tensors_digest(read_tensors(final)) == old.digest
                except Exception:  # noqa: BLE001 (unreadable is not intact)
                    intact = False
                if intact:
                    return old
                print(f"rl: warning: {final}: its files no longer give digest {old.digest[:16]}...; "
                      "writing the same weights again", flush=True)
            # its weights were pruned (keep_publications) or damaged on disk before the run stopped:
            # write them again, under the recorded manifest, so the engine can load that version
            write_json_atomic(tmp / MANIFEST, old.to_dict())
            fsync_files(tmp)
            pruned = final.with_name(f".{final.name}.pruned")
            os.replace(final, pruned)
            os.replace(tmp, final)
            shutil.rmtree(pruned)
            return old
        if existing and version != existing[-1] + 1:
            raise PublicationError(f"{root}: version {version} does not follow the latest, v{existing[-1]:06d}")
        write_json_atomic(tmp / MANIFEST, manifest.to_dict())
        fsync_files(tmp)
        os.replace(tmp, final)
    return manifest


def verify(pub_dir: str | os.PathLike) -> tuple[Manifest, str]:
    """Read a publication's tensors, recompute the digest and refuse a mismatch; returns (manifest, digest)."""
    manifest, digest, _ = read_verified(pub_dir)
    return manifest, digest


def read_verified(pub_dir: str | os.PathLike) -> tuple[Manifest, str, dict[str, Tensor]]:
    """The manifest, digest and tensors of a publication whose recomputed digest matches its manifest.

    The tensors returned are the ones hashed (memory-mapped), so a loader that builds the model
    from them loads exactly the verified bytes with one read of the files.
    """
    manifest = Manifest.read(pub_dir)
    try:
        tensors = read_tensors(pub_dir)
    except Exception as e:  # a corrupted safetensors header cannot even be parsed
        raise DigestMismatch(f"{pub_dir}: unreadable tensors ({e}); refusing version {manifest.version}") from e
    digest = tensors_digest(tensors)
    if digest != manifest.digest:
        raise DigestMismatch(
            f"{pub_dir}: digest of the bytes read is {digest}, manifest says {manifest.digest}; refusing version "
            f"{manifest.version}"
        )
    return manifest, digest, tensors


def prune(root: str | os.PathLike, keep: int, protect: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """Remove the weights of all but the newest ``keep`` versions (0: keep all) and those in
    ``protect`` (versions a checkpoint may read its actor from); returns those pruned.

    ``manifest.json`` and ``config.json`` stay, so the run's record of every version and digest
    survives (``verify-resume`` compares manifests).
    """
    if keep <= 0:
        return []
    root = Path(root)
    versions = sorted(int(p.name[1:]) for p in root.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit())
    pruned = []
    for v in versions[:-keep]:
        if v in protect:
            continue
        d = version_dir(root, v)
        weights = [p for p in d.iterdir() if p.name not in (MANIFEST, "config.json")]
        for p in weights:
            p.unlink()
        if weights:
            pruned.append(v)
    return pruned
