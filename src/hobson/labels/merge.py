"""Merging label shards into the one-process file, byte for byte, without loading a model.

Every shard is checked against its ``.done`` marker (present, row count and sha256 matching the
bytes read), rows are read as raw lines and only their ``{"i": <int>, `` prefix is parsed. Indices
must cover ``0..M-1`` exactly once over all shards; the rows are then written in index order. The
heavy lifting (prefix scan, sort, join) runs in C (``re``, numpy, ``bytes.join``) so the merge
runs at a modest multiple of ``cat`` (bench/merge.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hobson.errors import DataError, DigestMismatch, StageError
from hobson.io import atomic_write, count_lines
from hobson.labels.shardfile import read_done
from hobson.shards import shard_paths

_HEAD_BYTES = b'{"i": '
_HEAD = len(_HEAD_BYTES)
_WRITE_LINES = 1 << 16


@dataclass(frozen=True)
class MergeResult:
    out: str
    rows: int
    sha256: str
    train_out: str | None = None
    train_sha256: str | None = None
    shift: int = 0


def train_path(out: str) -> str:
    """``teacher.jsonl`` -> ``teacher_train.jsonl``: the copy whose indices are shifted."""
    stem, ext = os.path.splitext(out)
    return f"{stem}_train{ext or '.jsonl'}"


def _read_shard(path: str, done_path: str) -> tuple[list[bytes], np.ndarray]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise StageError(f"{path}: missing shard file (rerun this shard)") from None
    if not os.path.exists(done_path):
        raise StageError(f"{path}: unfinished shard: no {os.path.basename(done_path)} marker "
                         "(rerun this shard)")
    done = read_done(done_path)
    if done is None:
        raise StageError(f"{path}: unreadable marker {done_path} (expected JSON with rows and sha256; "
                         "rerun this shard)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != done["sha256"]:
        raise DigestMismatch(f"{path}: sha256 {digest} differs from {done['sha256']} recorded in {done_path} "
                             "(the file changed after the shard finished; rerun this shard)")
    if data and not data.endswith(b"\n"):
        raise DataError(f"{path}: last line has no newline (truncated)")
    lines = data.split(b"\n")
    lines.pop()  # the empty string after the final newline
    if len(lines) != done["rows"]:
        raise StageError(f"{path}: {len(lines)} rows but {done_path} records {done['rows']}")
    idx = _scan_indices(data, len(lines), path)
    if idx.size > 1:
        bad = np.flatnonzero(idx[1:] <= idx[:-1])
        if bad.size:
            k = int(bad[0]) + 1
            raise DataError(f"{path}:{k + 1}: index {idx[k]} after {idx[k - 1]}: shard rows must be sorted "
                            "by strictly increasing index")
    return lines, idx


def _scan_indices(data: bytes, n_lines: int, path: str) -> np.ndarray:
    """The ``<int>`` of every line's ``{"i": <int>, `` prefix, parsed with numpy (no per-line Python)."""
    if n_lines == 0:
        return np.zeros(0, dtype=np.int64)
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buf == 0x0A)
    starts = np.concatenate(([0], ends[:-1] + 1))
    # Shortest valid line: '{"i": 0, ' plus at least one more byte before the newline.
    ok = (ends - starts) >= _HEAD + 4
    safe = np.where(ok, starts, 0)  # keep every probe inside the buffer for short lines
    for j, ch in enumerate(_HEAD_BYTES):
        ok &= buf[safe + j] == ch
    pos = safe + _HEAD
    value = np.zeros(n_lines, dtype=np.int64)
    ndig = np.zeros(n_lines, dtype=np.int64)
    active = ok.copy()
    for _ in range(18):  # int64 holds 18 digits; a longer run fails the comma check below
        c = buf[np.minimum(pos + ndig, buf.size - 1)].astype(np.int64)
        active &= (c >= 0x30) & (c <= 0x39)
        if not active.any():
            break
        value = np.where(active, value * 10 + (c - 0x30), value)
        ndig += active
    end = np.minimum(pos + ndig, buf.size - 2)
    ok &= (ndig >= 1) & (buf[end] == 0x2C) & (buf[end + 1] == 0x20)
    ok &= ~((ndig > 1) & (buf[pos] == 0x30))  # leading zeros would break the prefix rewrite
    bad = np.flatnonzero(~ok)
    if bad.size:
        raise DataError(f"{path}:{int(bad[0]) + 1}: line does not start with '{{\"i\": <index>, '")
    return value


def _owner(paths: Sequence[str], idxs: Sequence[np.ndarray], i: int) -> list[str]:
    """The shard files holding index ``i`` (each shard's indices are sorted)."""
    found = []
    for p, a in zip(paths, idxs, strict=True):
        k = int(np.searchsorted(a, i))
        if k < a.size and a[k] == i:
            found.append(p)
    return found


def merge_shards(
    out: str, num_shards: int, shift_by: Sequence[str] = (), expected_rows: int | None = None
) -> MergeResult:
    """Merge the ``num_shards`` shards of ``out`` into ``out`` (and ``<stem>_train.jsonl`` if shifting).

    ``shift_by``: training files that precede this one in the concatenated training set; the extra
    ``_train`` file carries indices offset by their total line count, ``out`` keeps the unshifted
    ones. Refuses (naming the shard file, writing nothing) a missing shard, a missing or mismatched
    ``.done``, overlapping indices, gaps, or a row count other than ``expected_rows``.
    """
    if num_shards < 1:
        raise StageError(f"--num-shards must be >= 1, got {num_shards}")
    paths: list[str] = []
    all_lines: list[bytes] = []
    idxs: list[np.ndarray] = []
    for s in range(num_shards):
        path, done_path = shard_paths(out, s, num_shards)
        lines, idx = _read_shard(path, done_path)
        paths.append(path)
        all_lines.extend(lines)
        idxs.append(idx)
    total = len(all_lines)
    flat = np.concatenate(idxs) if idxs else np.zeros(0, dtype=np.int64)
    order = np.argsort(flat, kind="stable")
    ranked = flat[order]
    if total > 1:
        dup = np.flatnonzero(ranked[1:] == ranked[:-1])
        if dup.size:
            i = int(ranked[dup[0]])
            owners = " and ".join(_owner(paths, idxs, i))
            raise StageError(f"overlapping shards: row index {i} is in {owners}")
    off = np.flatnonzero(ranked != np.arange(total))
    if off.size:
        k = int(off[0])
        after = int(ranked[k])
        raise StageError(f"gap: no shard holds row index {k}; {_owner(paths, idxs, after)[0]} holds index "
                         f"{after} but the {num_shards} shards hold only {total} rows")
    if expected_rows is not None and total != expected_rows:
        missing = f": rows {total}..{expected_rows - 1} are missing" if total < expected_rows else ""
        raise StageError(f"the {num_shards} shards ({', '.join(paths)}) hold {total} rows, "
                         f"expected {expected_rows}{missing}")
    shift = sum(_line_count(f) for f in shift_by)
    ordered = list(map(all_lines.__getitem__, order.tolist()))
    del all_lines
    with atomic_write(out, "wb") as f:
        digest = _write_lines(f, ordered, 0)
        if not shift_by:
            return MergeResult(out, total, digest)
        train_out = train_path(out)
        with atomic_write(train_out, "wb") as g:
            train_digest = _write_lines(g, ordered, shift)
    return MergeResult(out, total, digest, train_out, train_digest, shift)


def _line_count(path: str) -> int:
    try:
        return count_lines(path)
    except FileNotFoundError:
        raise StageError(f"--shift-by {path}: no such training file") from None


def _write_lines(f, ordered: list[bytes], shift: int) -> str:
    """Write ``ordered`` (row ``k`` at position ``k``) with newlines, indices shifted by ``shift``."""
    h = hashlib.sha256()
    for start in range(0, len(ordered), _WRITE_LINES):
        chunk = ordered[start:start + _WRITE_LINES]
        if shift:
            chunk = [b'{"i": %d%s' % (k + shift, line[_HEAD + len(str(k)):])
                     for k, line in enumerate(chunk, start)]
        block = b"\n".join(chunk) + b"\n"
        h.update(block)
        f.write(block)
    return h.hexdigest()
