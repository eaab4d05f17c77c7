"""The label row format and a shard's file + ``.done`` marker.

A label row is ``{"i": 12, "probs": [0.125000, 0.875000]}``: the bytes are written here, not by a
JSON library, so six decimals are pinned (``json.dumps`` would print ``0.125``). The merge relies on
every row starting with ``{"i": <int>, `` to read indices without parsing JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence

from hobson.io import atomic_write, sha256_file, write_json_atomic


def format_label_line(i: int, probs: Sequence[float]) -> str:
    """One label row with its trailing newline; refuses non-finite or negative probabilities."""
    for p in probs:
        if not (math.isfinite(p) and p >= 0.0):
            raise ValueError(f"row {i}: probability {p!r} is not a finite non-negative number")
    return f'{{"i": {int(i)}, "probs": [{", ".join(f"{p:.6f}" for p in probs)}]}}\n'


def read_done(done_path: str | os.PathLike) -> dict | None:
    """The marker's ``{"rows", "sha256"}``, or None when it is absent or unreadable."""
    try:
        with open(done_path, encoding="utf-8") as f:
            done = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict):
        return None
    if not (isinstance(done.get("rows"), int) and isinstance(done.get("sha256"), str)):
        return None
    return done


def shard_is_done(path: str | os.PathLike, done_path: str | os.PathLike) -> bool:
    """True when the marker exists and the shard file's sha256 matches it."""
    done = read_done(done_path)
    if done is None or not os.path.exists(path):
        return False
    return sha256_file(path) == done["sha256"]


def write_shard(
    path: str | os.PathLike, done_path: str | os.PathLike, lines: Iterable[str]
) -> tuple[int, str]:
    """Write the shard file atomically, then (last) its ``.done`` marker. Returns (rows, sha256)."""
    data = "".join(lines).encode("utf-8")
    # A stale marker must not vouch for the new file while it is being replaced.
    if os.path.exists(done_path):
        os.unlink(done_path)
    with atomic_write(path, "wb") as f:
        f.write(data)
    digest = hashlib.sha256(data).hexdigest()
    rows = data.count(b"\n")
    write_json_atomic(done_path, {"rows": rows, "sha256": digest})
    return rows, digest
