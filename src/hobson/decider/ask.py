"""Asking a checkpoint one question from the command line.

``--choice 'Q=a,b,c'`` is one question: the instruction ``Q`` and its options ``a``, ``b``, ``c``
(an option may carry a description after a colon: ``'Q=yes:it holds,no:it does not'``). Each
question becomes a corpus row with the given ``--state`` and ``--kind`` and is answered with the
checkpoint's calibrated probabilities, options in the order given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hobson.decider.metrics import argmax
from hobson.decider.predict import LoadedDecider, predict_logits, probabilities
from hobson.errors import ConfigError

KINDS = ("choice", "noul", "score")


def parse_choice(spec: str, state: str, kind: str = "choice") -> dict[str, Any]:
    """``'Q=a,b'`` -> a corpus row (label 0 is a placeholder: asking needs no gold answer)."""
    question, sep, opts = spec.partition("=")
    if not sep or not question.strip():
        raise ConfigError(f"--choice {spec!r}: expected 'QUESTION=option1,option2,...'")
    options = []
    for part in opts.split(","):
        name, _, desc = part.partition(":")
        if not name.strip():
            raise ConfigError(f"--choice {spec!r}: an empty option name")
        options.append([name.strip(), desc.strip()])
    if len(options) < 2:
        raise ConfigError(f"--choice {spec!r}: give at least two options, separated by commas")
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r} is not one of {', '.join(KINDS)}")
    return {"kind": kind, "state": state, "instructions": question.strip(), "options": options, "label": 0,
            "task": "ask", "weight": 1.0, "instruction_variants": []}


def ask(loaded: LoadedDecider, rows: Sequence[dict[str, Any]]) -> list[list[float]]:
    return probabilities(predict_logits(loaded, rows), rows, loaded.temperatures)


def format_answers(rows: Sequence[dict[str, Any]], probs: Sequence[Sequence[float]]) -> str:
    out = []
    for row, p in zip(rows, probs, strict=True):
        best = argmax(p)
        out.append(row["instructions"])
        for j, ((name, desc), pj) in enumerate(zip(row["options"], p, strict=True)):
            mark = "*" if j == best else " "
            out.append(f"  {mark} {pj:.4f}  {name}{': ' + desc if desc else ''}")
    return "\n".join(out) + "\n"
