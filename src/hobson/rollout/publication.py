"""Versioned policy publications: how the trainer hands weights to the rollout engine.

Layout: ``<output>/publications/v{N:06d}/`` holding the provider's export (``config.json``,
``model.safetensors`` or shards) with ``model.safetensors.index.json`` always present, and
``manifest.json``::

    {"version": N, "digest": "<sha256>", "model_revision": ..., "engine_revision": ...,
     "dtype": "float32", "model_type": ..., "files": {name: {"bytes": n}}}

The digest is SHA-256 over every tensor in name order: name, dtype, shape, then the SHA-256 of
each 64 MiB piece of its raw bytes (:func:`tensors_digest`, parallel over the pieces); the engine
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
from hobson.io import disk_full_is_an_error, write_json_atomic
from hobson.models.common import DTYPE_NAMES, INDEX_FILE, SINGLE_FILE, SafetensorsDir

MANIFEST = "manifest.json"


class PublicationError(HobsonError):
    """A publication is missing, inconsistent or may not be loaded now."""


def version_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


DIGEST_CHUNK = 64 * 1024**2  # bytes per SHA-256 leaf of the digest


def _tensor_view(t: Tensor) -> Any:
    """The tensor's bytes as a flat uint8 numpy view (no copy for a contiguous CPU tensor)."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def _sha(buf: Any) -> bytes:
    import hashlib

    return hashlib.sha256(buf).digest()  # releases the GIL: the leaves hash in parallel


def tensors_digest(tensors: dict[str, Tensor], workers: int | None = None) -> str:
    """SHA-256 over the tensors in name order, of ``name\0dtype\0shape\0`` then the SHA-256 of
    each ``DIGEST_CHUNK``-byte piece of the raw bytes.

    Two levels so that the pieces hash on every core at once: one SHA-256 stream over 7 GB
    takes seconds at ~2 GB/s, and every publication is hashed by the writer and by the engine.
    """
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(tensors)
    views = {n: _tensor_view(tensors[n]) for n in names}
    pieces = [(n, i) for n in names for i in range(0, max(len(views[n]), 1), DIGEST_CHUNK)]
    with ThreadPoolExecutor(max_workers=workers or min(32, os.cpu_count() or 1)) as pool:
        leaves = list(pool.map(lambda ni: _sha(views[ni[0]][ni[1] : ni[1] + DIGEST_CHUNK]), pieces))
    h = hashlib.sha256()
    it = iter(leaves)
    for n in names:
        t = tensors[n]
        h.update(f"{n}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        for _ in range(0, max(len(views[n]), 1), DIGEST_CHUNK):
            h.update(next(it))
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
    """Version ``version`` of ``actor`` as tensors, config and manifest, with no file written."""
    tensors, config = provider.export_state(actor, dtype=dtype)
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
        provider.export(actor, tmp, dtype=dtype)
        if not (tmp / INDEX_FILE).exists():
            # single-file exports get an index too, so every publication reads the same way
            names = SafetensorsDir(tmp).names()
            with open(tmp / INDEX_FILE, "w", encoding="utf-8") as f:
                json.dump(
                    {"metadata": {}, "weight_map": dict.fromkeys(names, SINGLE_FILE)}, f, indent=2, sort_keys=True
                )
                f.write("\n")
        digest = tensors_digest(read_tensors(tmp))
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
            _fsync_dir_files(tmp)
            pruned = final.with_name(f".{final.name}.pruned")
            os.replace(final, pruned)
            os.replace(tmp, final)
            shutil.rmtree(pruned)
            return old
        if existing and version != existing[-1] + 1:
            raise PublicationError(f"{root}: version {version} does not follow the latest, v{existing[-1]:06d}")
        write_json_atomic(tmp / MANIFEST, manifest.to_dict())
        _fsync_dir_files(tmp)
        os.replace(tmp, final)
    return manifest


def _fsync_dir_files(d: Path) -> None:
    for p in d.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


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
