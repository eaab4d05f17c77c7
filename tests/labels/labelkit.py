"""Helpers for the labelling tests: a hand-rolled corpus, the test batch budget, sha256."""

from __future__ import annotations

import hashlib
import random

from hobson.io import dumps_row

# Small budgets so 60 rows make ~10 batches of different widths.
BATCH = {"max_batch_tokens": 600, "max_batch_rows": 8}
NAMES = ["apple", "river", "seven", "north", "green", "quick", "stone", "ember", "lunar", "maple", "cobalt"]


def sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def make_rows(n: int = 60, seed: int = 0) -> list[dict]:
    """Rows of all three kinds with 2..7 options and states of varied length (so batches vary)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(2, 7)
        options = [[rng.choice(NAMES) + str(j), " ".join(rng.choices(NAMES, k=rng.randint(0, 3)))] for j in range(k)]
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        rows.append({
            "kind": ["noul", "choice", "score"][i % 3],
            "state": " ".join(rng.choices(NAMES, k=rng.randint(0, 25))) + f" value {a} against {b}",
            "instructions": f"Pick the option that fits row {i}.",
            "options": options,
            "label": rng.randrange(k),
            "task": f"family{i % 4}",
            "weight": 1.0,
            "instruction_variants": [],
        })
    return rows


def write_corpus(path, rows) -> str:
    path.write_text("".join(dumps_row(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)
