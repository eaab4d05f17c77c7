"""Shard arithmetic shared by labelling stages, the merge, the launcher and retry.

Shards cut whole batches of the one-process batching, never rows: shard ``i`` of ``N`` owns
batch numbers ``b`` with ``b % N == i``. So every row is computed in exactly the batch it would
be computed in by one process, and the merge can reproduce the one-process file byte for byte
even when a model's output depends on the padded batch width.
"""

from __future__ import annotations

import os

from hobson.errors import ConfigError


def shard_batches(n_batches: int, rank: int, world: int) -> list[int]:
    """Batch numbers owned by shard ``rank`` of ``world`` (round-robin over whole batches)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard {rank} of {world} is out of range")
    return list(range(rank, n_batches, world))


def parse_spec(spec: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]`` (sorted, unique)."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ConfigError(f"bad shard list {spec!r}: expected e.g. '0-7' or '1,3,5'") from None
    if not out:
        raise ConfigError(f"empty shard list {spec!r}")
    return sorted(out)


def format_spec(shards: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"``: compact, so 10,000 shards stay a short argument."""
    xs = sorted(set(shards))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def task_shard(shards: list[int], task_index: int | None) -> int:
    """The shard an array task runs: ``shards[task_index]``, index from ``HOBSON_ARRAY_TASK``."""
    if task_index is None:
        env = os.environ.get("HOBSON_ARRAY_TASK")
        if env is None:
            if len(shards) == 1:
                return shards[0]
            raise ConfigError("no --task-index and HOBSON_ARRAY_TASK is unset for a multi-shard array")
        task_index = int(env)
    if not 0 <= task_index < len(shards):
        raise ConfigError(f"task index {task_index} outside the {len(shards)} shards {format_spec(shards)}")
    return shards[task_index]


def shard_paths(out: str, shard: int, num_shards: int) -> tuple[str, str]:
    """``(<out>.shard<i>of<N>.jsonl, its .done marker)`` for an output ``<out>.jsonl``."""
    stem = out[: -len(".jsonl")] if out.endswith(".jsonl") else out
    path = f"{stem}.shard{shard}of{num_shards}.jsonl"
    return path, path + ".done"
