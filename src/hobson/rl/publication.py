"""Versioned policy publications: how the trainer hands weights to the rollout engine.

Layout: ``<output>/publications/v{N:06d}/`` holding the provider's export (``config.json``,
``model.safetensors`` or shards) with ``model.safetensors.index.json`` always present, and
``manifest.json``::

    {"version": N, "digest": "<sha256>", "model_revision": ..., "engine_revision": ...,
     "dtype": "float32", "model_type": ..., "files": {name: {"bytes": n, "sha256": ...}}}

The digest is SHA-256 over every tensor in name order: name, dtype, shape, then the raw bytes
(:func:`tensors_digest`); the engine recomputes it from the bytes it read and refuses a
mismatch. A version is written to a temporary sibling and renamed into place, so a reader never
sees half a publication. Versions increase by one; publishing a version that already exists (a
resumed run republishing its restored weights) is allowed only if the digest is the same.
Critics are refused (``Provider.export``): a critic never appears in a publication.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hobson.errors import DigestMismatch, HobsonError
from hobson.io import sha256_file, write_json_atomic
from hobson.models.common import DTYPE_NAMES, INDEX_FILE, SINGLE_FILE, SafetensorsDir

MANIFEST = "manifest.json"


class PublicationError(HobsonError):
    """A publication is missing, inconsistent or may not be loaded now."""


def version_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def _tensor_bytes(t: Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensors_digest(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over the tensors in name order: ``name\\0dtype\\0shape\\0`` then the raw bytes."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        h.update(_tensor_bytes(t))
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
    with tempfile.TemporaryDirectory(prefix=f".v{version:06d}.", dir=root) as tmp_root:
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
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
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
            return old
        if existing and version != existing[-1] + 1:
            raise PublicationError(f"{root}: version {version} does not follow the latest, v{existing[-1]:06d}")
        write_json_atomic(tmp / MANIFEST, manifest.to_dict())
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    return manifest


def verify(pub_dir: str | os.PathLike) -> tuple[Manifest, str]:
    """Read a publication's tensors, recompute the digest and refuse a mismatch; returns (manifest, digest)."""
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
    return manifest, digest
