"""The frozen-targets route: the final model's teacher file from teacher and replay labels.

``distill`` writes one ``{"i", "probs"}`` file in the training-row index space (the concatenated
``train_files``; use the ``*_train.jsonl`` label files, whose indices the merge shifted):

1. every teacher line whose argmax (first index on ties) equals the row's gold ``label``, in the
   teacher files' order, bytes unchanged; teacher lines that disagree with gold are dropped;
2. then, appended, every replay line (the parent's own distribution) for a row that step 1 did
   not keep, in the replay files' order, bytes unchanged; replay lines for rows the teacher
   already covers are dropped (one target per row: the trainer refuses duplicates).

So a row gets the teacher's distribution where the teacher was right, the parent's elsewhere, and
the final model trains from this file alone, without loading a parent or a teacher.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hobson.decider.metrics import argmax
from hobson.errors import DataError
from hobson.io import atomic_write


@dataclass(frozen=True)
class DistillResult:
    out: str
    rows: int
    sha256: str
    teacher_rows: int
    teacher_kept: int
    replay_rows: int
    replay_appended: int


def _label_lines(paths: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, list[float], bytes]]:
    out = []
    seen: dict[int, str] = {}
    for path in paths:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                at = f"{path}:{lineno}"
                if not raw.endswith(b"\n"):
                    raise DataError(f"{at}: last line has no newline (truncated)")
                try:
                    obj = json.loads(raw)
                except ValueError as e:
                    raise DataError(f"{at}: not valid JSON ({e})") from None
                if not (isinstance(obj, dict) and isinstance(obj.get("i"), int)
                        and isinstance(obj.get("probs"), list)):
                    raise DataError(f"{at}: a label line must be {{\"i\": int, \"probs\": [...]}}")
                i, probs = obj["i"], obj["probs"]
                if not 0 <= i < len(rows):
                    raise DataError(f"{at}: i={i} is outside the {len(rows)} training rows "
                                    "(use the *_train.jsonl files, whose indices are shifted)")
                if len(probs) != len(rows[i]["options"]):
                    raise DataError(f"{at}: {len(probs)} probs for training row {i} with "
                                    f"{len(rows[i]['options'])} options")
                if i in seen:
                    raise DataError(f"{at}: i={i} already labelled at {seen[i]}")
                seen[i] = at
                out.append((i, probs, raw))
    return out


def distill(train_files: Sequence[str], teacher_files: Sequence[str], replay_files: Sequence[str],
            out: str | os.PathLike) -> DistillResult:
    """Write the final teacher file (see the module docstring); nothing is written on an error."""
    from hobson.decider.train import read_training_rows

    rows = read_training_rows(list(train_files))
    teacher = _label_lines(teacher_files, rows)
    replay = _label_lines(replay_files, rows)
    kept = [(i, raw) for i, probs, raw in teacher if argmax(probs) == rows[i]["label"]]
    covered = {i for i, _ in kept}
    appended = [(i, raw) for i, _, raw in replay if i not in covered]
    h = hashlib.sha256()
    with atomic_write(out, "wb") as f:
        for _, raw in (*kept, *appended):
            f.write(raw)
            h.update(raw)
    return DistillResult(str(out), len(kept) + len(appended), h.hexdigest(), len(teacher), len(kept),
                         len(replay), len(appended))
