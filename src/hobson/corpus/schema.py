"""The decider row schema: one JSON object per line, keys in a fixed order.

``{"kind", "state", "instructions", "options", "label", "task", "weight", "instruction_variants"}``

- ``noul``: a verdict with fixed options (yes / no / unknown);
- ``choice``: pick one of named options;
- ``score``: ordered (ordinal) options; training applies ordinal smoothing to these.

Extra keys are allowed only where a file declares them (the paired eval sets add ``"pair"``
after the schema keys), so a typo in a field name is caught instead of silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from hobson.errors import DataError
from hobson.io import iter_jsonl

KINDS = ("noul", "choice", "score")
FIELDS = ("kind", "state", "instructions", "options", "label", "task", "weight", "instruction_variants")

# The verdict options every noul row carries, in this canonical order (teacher probabilities
# are attached by option position, so the order is part of the data contract).
NOUL_OPTIONS: list[list[str]] = [
    ["yes", "the statement holds"],
    ["no", "the statement does not hold"],
    ["unknown", "the given facts do not decide it"],
]
YES, NO, UNKNOWN = 0, 1, 2

NONE_OF_THESE = ["none of these", "no listed option is right"]

# Paired eval sets: their rows add an integer "pair" key after the schema keys.
PAIRED_FILES = ("consistency.jsonl", "flip.jsonl")


def make_row(
    kind: str,
    state: str,
    instructions: str,
    options: list[list[str]],
    label: int,
    task: str,
    instruction_variants: list[str],
    weight: float = 1.0,
) -> dict[str, Any]:
    """A row dict with the schema's key order (``dumps_row`` keeps insertion order)."""
    return {
        "kind": kind,
        "state": state,
        "instructions": instructions,
        "options": [list(o) for o in options],
        "label": label,
        "task": task,
        "weight": float(weight),
        "instruction_variants": list(instruction_variants),
    }


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_row(row: Any, path: str | os.PathLike, lineno: int, extra_keys: Iterable[str] = ()) -> None:
    """Raise ``DataError("path:lineno: ...")`` naming the first thing wrong with ``row``."""
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    allowed = FIELDS + tuple(extra_keys)
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(missing)}")
    extra = [k for k in row if k not in allowed]
    if extra:
        raise DataError(f"{where}: unknown field(s) {', '.join(extra)} (allowed: {', '.join(allowed)})")
    kind = row["kind"]
    if kind not in KINDS:
        raise DataError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    for key in ("state", "instructions", "task"):
        if not isinstance(row[key], str):
            raise DataError(f"{where}: field {key} must be a string, got {type(row[key]).__name__}")
    if not row["instructions"].strip():
        raise DataError(f"{where}: field instructions is empty")
    options = row["options"]
    if not isinstance(options, list):
        raise DataError(f"{where}: field options must be a list, got {type(options).__name__}")
    if not options:
        raise DataError(f"{where}: field options is empty")
    for i, opt in enumerate(options):
        if not (isinstance(opt, list) and len(opt) == 2 and all(isinstance(s, str) for s in opt)):
            raise DataError(f"{where}: options[{i}] must be [name, description] strings, got {opt!r}")
    label = row["label"]
    if not _is_int(label):
        raise DataError(f"{where}: field label must be an integer, got {type(label).__name__}")
    if not 0 <= label < len(options):
        raise DataError(f"{where}: label {label} out of range for {len(options)} options")
    weight = row["weight"]
    if not (isinstance(weight, (int, float)) and not isinstance(weight, bool)) or weight < 0:
        raise DataError(f"{where}: field weight must be a non-negative number, got {weight!r}")
    variants = row["instruction_variants"]
    if not (isinstance(variants, list) and all(isinstance(v, str) for v in variants)):
        raise DataError(f"{where}: field instruction_variants must be a list of strings")
    for key in extra_keys:
        if key in row and not _is_int(row[key]):
            raise DataError(f"{where}: field {key} must be an integer, got {type(row[key]).__name__}")


def _extra_for(path: str | os.PathLike, extra_keys: Iterable[str] | None) -> tuple[str, ...]:
    if extra_keys is not None:
        return tuple(extra_keys)
    return ("pair",) if os.path.basename(path) in PAIRED_FILES else ()


def iter_rows(path: str | os.PathLike, extra_keys: Iterable[str] | None = None) -> Iterator[dict[str, Any]]:
    """Stream validated rows from a JSONL corpus file (see :func:`read_rows`)."""
    extra = _extra_for(path, extra_keys)
    for lineno, row in iter_jsonl(path):
        validate_row(row, path, lineno, extra)
        yield row


def read_rows(path: str | os.PathLike, extra_keys: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """All rows of a corpus file, validated; the first bad row raises ``file:line: ...``.

    ``extra_keys`` names integer keys a file may add after the schema keys; by default
    ``("pair",)`` for files named ``consistency.jsonl`` / ``flip.jsonl`` and none otherwise.
    """
    return list(iter_rows(path, extra_keys))
