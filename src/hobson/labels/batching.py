"""The one-process batching that every shard recomputes identically.

Rows are sorted shortest first (ties by index) and packed greedily: a row joins the current batch
while ``rows x longest`` stays within the token budget and the row cap holds. Shards then take
whole batches (``hobson.shards.shard_batches``), so each row is scored in exactly the batch, at
exactly the padded width, it would have in a one-process run.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_rows: int) -> list[list[int]]:
    """Row indices per batch, batches in order. A row longer than the budget gets a batch alone."""
    if max_batch_tokens < 1 or max_batch_rows < 1:
        raise ValueError(f"max_batch_tokens={max_batch_tokens} and max_batch_rows={max_batch_rows} "
                         "must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so the newcomer is the longest row of the batch it would join.
        if current and ((len(current) + 1) * lengths[i] > max_batch_tokens or len(current) >= max_batch_rows):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
