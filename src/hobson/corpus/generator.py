"""Deterministic row streams: one ``random.Random`` per (stage, family, split, seed).

Determinism rules kept here so every family can rely on them: seeds are derived from
SHA-256 of a text key (never ``hash()``, which is salted per process), only pure-Python
``random.Random`` is used, and nothing iterates a set or dict whose order could vary.

Held-out splits are generated first, from their own seed streams; their states are
remembered (as 16-byte digests, so 10^6 rows stay small) and the train stream skips any row
whose state a held-out split already used, so no question leaks between splits.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hobson.errors import StageError

Row = dict[str, Any]

# A family that keeps colliding with held-out states has too small a question space for the
# requested scale; give up loudly instead of looping forever.
MAX_ATTEMPTS_PER_ROW = 200


@dataclass(frozen=True)
class Family:
    """A task family: ``make(rng)`` returns one row (or a group of rows sharing a state, e.g. a
    consistency pair); ``counts`` are rows (or groups) per split at scale 1."""

    name: str
    make: Callable[[random.Random], Row | list[Row]]
    counts: dict[str, int]


def family_rng(stage: str, family: str, split: str, seed: int) -> random.Random:
    digest = hashlib.sha256(f"hobson-corpus/{stage}/{family}/{split}/{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def state_key(row: Row) -> bytes:
    return hashlib.sha256(row["state"].encode("utf-8")).digest()[:16]


def scaled(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def split_groups(
    stage: str,
    families: list[Family],
    split: str,
    seed: int,
    scale: float,
    taken: set[bytes],
    remember: bool,
) -> Iterator[list[Row]]:
    """Rows of one split, families interleaved round-robin (so any prefix mixes every task).

    Rows whose state is in ``taken`` are skipped (and re-drawn from the same stream); with
    ``remember`` each emitted state is added to ``taken`` for the splits generated later.
    """
    rngs = [family_rng(stage, f.name, split, seed) for f in families]
    wanted = [scaled(f.counts[split], scale) for f in families]
    for i in range(max(wanted)):
        for fam, rng, n in zip(families, rngs, wanted, strict=True):
            if i >= n:
                continue
            for _ in range(MAX_ATTEMPTS_PER_ROW):
                made = fam.make(rng)
                group = made if isinstance(made, list) else [made]
                key = state_key(group[0])
                if key not in taken:
                    break
            else:
                raise StageError(
                    f"{stage}: family {fam.name} split {split}: no fresh question after "
                    f"{MAX_ATTEMPTS_PER_ROW} draws; its question space is too small for scale {scale:g}"
                )
            if remember:
                taken.add(key)
            yield group


def split_rows(
    stage: str,
    families: list[Family],
    split: str,
    seed: int,
    scale: float,
    taken: set[bytes],
    remember: bool,
) -> Iterator[Row]:
    for group in split_groups(stage, families, split, seed, scale, taken, remember):
        yield from group


def phrase(rng: random.Random, phrasings: list[str]) -> tuple[str, list[str]]:
    """Pick one phrasing as the row's instructions; the others become its variants."""
    i = rng.randrange(len(phrasings))
    return phrasings[i], phrasings[:i] + phrasings[i + 1 :]


def shuffled_options(
    rng: random.Random, correct: list[str], distractors: list[list[str]]
) -> tuple[list[list[str]], int]:
    """Options in a random order and the index of ``correct`` among them."""
    options = [correct] + distractors
    order = list(range(len(options)))
    rng.shuffle(order)
    return [options[j] for j in order], order.index(0)


def distinct_ints(rng: random.Random, correct: int, spread: list[int], k: int, modulus: int = 0) -> list[int]:
    """``k`` distinct wrong answers near ``correct`` (offsets drawn from ``spread``)."""
    out: list[int] = []
    pool = [correct + d for d in spread if d != 0]
    pool = [v % modulus for v in pool] if modulus else pool
    rng.shuffle(pool)
    for v in pool:
        if v != correct and v not in out:
            out.append(v)
        if len(out) == k:
            break
    return out
