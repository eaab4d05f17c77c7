"""McNemar's exact test per task between two checkpoints' predictions on the same rows.

Inputs are two ``predictions.jsonl`` files written by the evaluation
(:mod:`hobson.decider.evaluate`), or the evaluation directories holding them. Rows are paired by
``index``; both files must hold the same indices with the same labels and tasks (the same eval
files and half), else the comparison is refused. Per task and overall: accuracy of A and B, the
discordant counts (only A right, only B right) and the two-sided exact p-value
(:func:`hobson.decider.metrics.mcnemar_exact`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hobson.decider.evaluate import PREDICTIONS
from hobson.decider.metrics import mcnemar_exact
from hobson.errors import DataError
from hobson.io import iter_jsonl


def read_predictions(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / PREDICTIONS
    out: dict[int, dict[str, Any]] = {}
    for lineno, obj in iter_jsonl(p):
        if not isinstance(obj, dict) or not all(k in obj for k in ("index", "task", "label", "pred")):
            raise DataError(f"{p}:{lineno}: a prediction line needs index, task, label and pred")
        if obj["index"] in out:
            raise DataError(f"{p}:{lineno}: index {obj['index']} appears twice")
        out[obj["index"]] = obj
    return out


def _row(a_right: list[bool], b_right: list[bool]) -> dict[str, Any]:
    n = len(a_right)
    return {"rows": n, "accuracy_a": sum(a_right) / n, "accuracy_b": sum(b_right) / n,
            **mcnemar_exact(a_right, b_right)}


def compare(a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """``{"overall": {...}, "per_task": {task: {...}}}`` (see the module docstring)."""
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise DataError(f"the predictions cover different rows ({len(only_a)} only in A, e.g. {only_a[:3]}; "
                        f"{len(only_b)} only in B, e.g. {only_b[:3]}): evaluate both on the same files and half")
    tasks: dict[str, tuple[list[bool], list[bool]]] = {}
    all_a: list[bool] = []
    all_b: list[bool] = []
    for i in sorted(a):
        ra, rb = a[i], b[i]
        if ra["label"] != rb["label"] or ra["task"] != rb["task"]:
            raise DataError(f"row {i}: A has label {ra['label']} task {ra['task']!r}, B has label {rb['label']} "
                            f"task {rb['task']!r}: not the same eval rows")
        xa, xb = ra["pred"] == ra["label"], rb["pred"] == rb["label"]
        ta, tb = tasks.setdefault(ra["task"], ([], []))
        ta.append(xa)
        tb.append(xb)
        all_a.append(xa)
        all_b.append(xb)
    if not all_a:
        raise DataError("no predictions to compare")
    return {"overall": _row(all_a, all_b), "per_task": {t: _row(*v) for t, v in sorted(tasks.items())}}


def format_comparison(result: Mapping[str, Any], name_a: str, name_b: str) -> str:
    out = [f"A = {name_a}", f"B = {name_b}", "",
           "| task | rows | acc A | acc B | only A | only B | McNemar p |", "|---|---|---|---|---|---|---|"]
    rows = [("all", result["overall"]), *result["per_task"].items()]
    for name, r in rows:
        out.append(f"| {name} | {r['rows']} | {r['accuracy_a']:.4f} | {r['accuracy_b']:.4f} | {r['only_a']} | "
                   f"{r['only_b']} | {r['p_value']:.4g} |")
    return "\n".join(out) + "\n"
