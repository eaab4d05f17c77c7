"""Checkpoint manifests: per-file SHA-256 and size, written last, verified on every load.

A checkpoint directory (RL or decider) is written in a temporary sibling and renamed into place
(``hobson.io.atomic_dir``); its ``manifest.json`` is the last file written there, so a directory
without one is incomplete. :func:`verify` re-hashes every file the manifest lists and raises
:class:`ManifestMismatch` naming the file and why (missing, truncated, changed). A corrupt
checkpoint found by a resume is renamed ``<name>.corrupt`` by :func:`set_aside` (kept for
inspection, never listed again) and the next older one is tried.

A file over :data:`CHUNK` bytes is hashed as CHUNK-byte ranges (``sha256_chunks``, the SHA-256
of each range in order), every range of every file at once on the pool of :mod:`hobson.bytepool`:
one SHA-256 over a whole file cannot be split across cores, and a 35 GB Huginn checkpoint took
~20 s on one. Smaller files keep a whole-file ``sha256``; a manifest written before chunking
(whole-file ``sha256`` of a large file) still verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hobson import bytepool
from hobson.errors import StageError

MANIFEST = "manifest.json"
CHUNK = 256 << 20
_READ = 8 << 20


class ManifestMismatch(StageError):
    """A checkpoint's bytes differ from its manifest, or a part of it is missing or unreadable."""


def _sha256_range(path: Path, start: int, length: int) -> str:
    h = hashlib.sha256()
    buf = bytearray(min(_READ, max(length, 1)))
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        end = start + length
        while start < end:
            n = os.preadv(fd, [view[: min(len(buf), end - start)]], start)
            if n == 0:
                raise ManifestMismatch(f"{path}: ended at byte {start}, before {end} (truncated while hashed)")
            h.update(view[:n])
            start += n
    finally:
        os.close(fd)
    return h.hexdigest()


def _ranges(size: int, chunk: int | None) -> list[tuple[int, int]]:
    if chunk is None:
        return [(0, size)]
    return [(a, min(chunk, size - a)) for a in range(0, size, chunk)] or [(0, 0)]


def _hash_all(jobs: list[tuple[Path, int | None]]) -> list[list[str]]:
    """For each (file, chunk bytes or None for whole), the SHA-256 of its ranges, all in parallel."""
    ranges = [_ranges(p.stat().st_size, chunk) for p, chunk in jobs]
    flat = [(p, a, n) for (p, _), rs in zip(jobs, ranges, strict=True) for a, n in rs]
    digests = iter(bytepool.pool().map(lambda job: _sha256_range(*job), flat))
    return [[next(digests) for _ in rs] for rs in ranges]


def _check_entry(where: Path, name: str, want: Any) -> None:
    """An entry a manifest lists is well formed, else one clear error (the file was edited or damaged)."""
    ok = isinstance(want, dict) and type(want.get("bytes")) is int
    if ok and "chunk_bytes" in want:
        chunk, chunks = want["chunk_bytes"], want.get("sha256_chunks")
        if type(chunk) is not int or chunk <= 0:
            raise ManifestMismatch(f"{where}: {name}'s chunk_bytes is {chunk!r}, not a positive integer")
        ok = isinstance(chunks, list) and all(isinstance(c, str) for c in chunks)
    elif ok:
        ok = isinstance(want.get("sha256"), str)
    if not ok:
        raise ManifestMismatch(f"{where}: unreadable entry for {name} (needs bytes and sha256, or chunk_bytes "
                               "and sha256_chunks); the checkpoint cannot be verified")


def entry(path: Path, chunks: list[str], chunk: int | None) -> dict[str, Any]:
    size = path.stat().st_size
    if chunk is None:
        return {"bytes": size, "sha256": chunks[0]}
    return {"bytes": size, "chunk_bytes": chunk, "sha256_chunks": chunks}


def digest(entry: dict[str, Any]) -> str:
    """One string naming a file's bytes: its SHA-256, or for a chunked file that of its chunk digests."""
    if "sha256" in entry:
        return entry["sha256"]
    return "chunks:" + hashlib.sha256("".join(entry["sha256_chunks"]).encode()).hexdigest()


def write(directory: Path, **fields: Any) -> dict[str, dict[str, Any]]:
    """Hash every file of ``directory`` (just written: from the page cache) and write the
    manifest (``fields`` plus ``files``) last, fsynced; returns ``files``."""
    paths = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST]
    jobs = [(p, CHUNK if p.stat().st_size > CHUNK else None) for p in paths]
    files = {p.name: entry(p, d, chunk) for (p, chunk), d in zip(jobs, _hash_all(jobs), strict=True)}
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
    listed = sorted(manifest["files"].items())
    for name, want in listed:
        _check_entry(directory / MANIFEST, name, want)
    for name, want in listed:
        f = directory / name
        if not f.is_file():
            raise ManifestMismatch(f"{f}: missing (the manifest lists it)")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise ManifestMismatch(f"{f}: {size} bytes, the manifest says {want['bytes']} (truncated or extended)")
    jobs = [(directory / name, want.get("chunk_bytes")) for name, want in listed]
    for (f, chunk), (_, want), found in zip(jobs, listed, _hash_all(jobs), strict=True):
        expected = [want["sha256"]] if chunk is None else want["sha256_chunks"]
        for i, (a, b) in enumerate(zip(found, expected, strict=False)):
            if a != b:
                where = "" if chunk is None else f" bytes {i * chunk}-{min((i + 1) * chunk, want['bytes']) - 1}:"
                raise ManifestMismatch(f"{f}:{where} sha256 {a}, the manifest says {b} "
                                       "(the bytes changed after it was written, or the manifest did)")
        if len(found) != len(expected):
            raise ManifestMismatch(f"{f}: {len(found)} chunks, the manifest lists {len(expected)}")


def set_aside(path: Path) -> Path:
    """Rename a corrupt checkpoint to ``<name>.corrupt`` (kept for inspection; never listed again)."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt{n}")
    os.replace(path, target)
    return target
