"""Labelling one shard: plan the one-process batches, score this shard's batches, write the shard.

The scorer is a parameter so the teacher stage and the decider's replay stage (the student's own
option distributions) share the batching, the sharding and the file format.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hobson.errors import StageError
from hobson.labels.batching import plan_batches
from hobson.labels.shardfile import format_label_line, read_done, shard_is_done, write_shard
from hobson.shards import shard_batches, shard_paths

DEFAULT_MAX_BATCH_TOKENS = 8192
DEFAULT_MAX_BATCH_ROWS = 64


class RowScorer(Protocol):
    """What ``label_rows`` needs from a model."""

    def lengths(self, rows: Sequence[dict[str, Any]]) -> list[int]:
        """Token length of each row's input, as it will be padded (drives the batching)."""

    def score_batch(self, rows: Sequence[dict[str, Any]]) -> list[list[float]]:
        """One probability list per row, in canonical option order, for one padded batch."""


@dataclass(frozen=True)
class ShardResult:
    path: str
    done_path: str
    rows: int
    sha256: str
    batches: int
    skipped: bool


def label_rows(
    rows: Sequence[dict[str, Any]],
    scorer: RowScorer,
    *,
    out: str,
    shard: int = 0,
    num_shards: int = 1,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
    on_batch: Callable[[int, int], None] | None = None,
) -> ShardResult:
    """Score shard ``shard`` of ``num_shards`` and write ``<out>.shard<i>of<N>.jsonl`` + ``.done``.

    Row ``i`` is ``rows[i]`` (the corpus line ``i + 1``). A shard whose ``.done`` matches its file
    is skipped. ``on_batch(done, total)`` is called after each batch (progress reporting).
    """
    path, done_path = shard_paths(out, shard, num_shards)
    if shard_is_done(path, done_path):
        done = read_done(done_path)
        return ShardResult(path, done_path, done["rows"], done["sha256"], 0, skipped=True)
    batches = plan_batches(scorer.lengths(rows), max_batch_tokens, max_batch_rows)
    mine = shard_batches(len(batches), shard, num_shards)
    labelled: list[tuple[int, str]] = []
    for n, b in enumerate(mine):
        batch = batches[b]
        probs = scorer.score_batch([rows[i] for i in batch])
        if len(probs) != len(batch):
            raise StageError(f"scorer returned {len(probs)} rows for a batch of {len(batch)}")
        for i, p in zip(batch, probs, strict=True):
            if len(p) != len(rows[i]["options"]):
                raise StageError(f"row {i}: scorer returned {len(p)} probabilities for "
                                 f"{len(rows[i]['options'])} options")
            try:
                labelled.append((i, format_label_line(i, p)))
            except ValueError as e:
                raise StageError(f"{e} (batch {b}; is the model producing NaN?)") from None
        if on_batch is not None:
            on_batch(n + 1, len(mine))
    labelled.sort()
    n_rows, digest = write_shard(path, done_path, (line for _, line in labelled))
    return ShardResult(path, done_path, n_rows, digest, len(mine), skipped=False)


def shard_done(out: str, shard: int, num_shards: int) -> bool:
    """True when shard ``shard`` of ``num_shards`` of ``out`` has a valid ``.done`` marker."""
    path, done_path = shard_paths(out, shard, num_shards)
    return os.path.exists(done_path) and shard_is_done(path, done_path)
