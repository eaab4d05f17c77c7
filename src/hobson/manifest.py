"""Checkpoint manifests: per-file SHA-256 and size, written last, verified on every load.

A checkpoint directory (RL or decider) is written in a temporary sibling and renamed into place
(``hobson.io.atomic_dir``); its ``manifest.json`` is the last file written there, so a directory
without one is incomplete. :func:`verify` re-hashes every file the manifest lists and raises
:class:`ManifestMismatch` naming the file and why (missing, truncated, changed). A corrupt
checkpoint found by a resume is renamed ``<name>.corrupt`` by :func:`set_aside` (kept for
inspection, never listed again) and the next older one is tried.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hobson.errors import StageError
from hobson.io import sha256_file

MANIFEST = "manifest.json"


class ManifestMismatch(StageError):
    """A checkpoint's bytes differ from its manifest, or a part of it is missing or unreadable."""


def write(directory: Path, **fields: Any) -> dict[str, dict[str, Any]]:
    """Hash every file of ``directory`` (just written: from the page cache) and write the
    manifest (``fields`` plus ``files``) last, fsynced; returns ``files``."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    with open(directory / MANIFEST, "w", encoding="utf-8") as f:
        f.write(json.dumps({**fields, "files": files}, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return files


def read(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory``, or None when it has none."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest.get("files"), dict):
            raise KeyError("files")
        return manifest
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestMismatch(f"{path}: unreadable manifest ({e})") from None


def verify(directory: Path, manifest: dict[str, Any]) -> None:
    """Every file ``manifest`` lists has its size and SHA-256; raises :class:`ManifestMismatch`."""
    for name, want in sorted(manifest["files"].items()):
        f = directory / name
        if not f.is_file():
            raise ManifestMismatch(f"{f}: missing (the manifest lists it)")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise ManifestMismatch(f"{f}: {size} bytes, the manifest says {want['bytes']} (truncated or extended)")
        digest = sha256_file(f)
        if digest != want["sha256"]:
            raise ManifestMismatch(f"{f}: sha256 {digest}, the manifest says {want['sha256']} "
                                   "(the bytes changed after it was written, or the manifest did)")


def set_aside(path: Path) -> Path:
    """Rename a corrupt checkpoint to ``<name>.corrupt`` (kept for inspection; never listed again)."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt{n}")
    os.replace(path, target)
    return target
