"""Evaluating a decider checkpoint: metrics overall, per kind and per task, and the paired sets.

Inputs: the eval files (concatenated in order; the *test half*, odd positions, by default — the
even positions calibrated the temperatures, :mod:`hobson.decider.calibrate`), and optionally the
catch-all eval file, the paraphrase-consistency pairs and the instruction-flip pairs (rows sharing
a ``"pair"`` key). Probabilities are the checkpoint's calibrated ones.

Outputs (in ``out_dir``, each written atomically):

- ``report.json``: ``overall``, ``per_kind``, ``per_task`` (:func:`hobson.decider.metrics.summary`
  each), ``confidence_bands``, ``reliability`` bins, ``catchall``, ``consistency``
  (``agreement``: share of pairs whose two rows get the same predicted option), ``flip``
  (``changed``: share of pairs whose predicted option changes, which it must; ``both_correct``).
- ``report.md``: the same as tables.
- ``predictions.jsonl``: one line per evaluated row: ``index`` (position in the concatenated eval
  files), ``task``, ``kind``, ``label``, ``pred``, ``probs`` (six decimals).
- ``reliability.png``: the reliability diagram (matplotlib, Agg backend).

Floats in the report keep six significant digits and paths only their last two components, so
reruns (in any directory) compare byte for byte.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hobson.decider import metrics
from hobson.decider.calibrate import split_half
from hobson.decider.predict import LoadedDecider, load_decider, predict_logits, probabilities
from hobson.errors import DataError
from hobson.io import atomic_write, dumps_row, write_json_atomic, write_text_atomic

REPORT_JSON, REPORT_MD, PREDICTIONS, RELIABILITY_PNG = (
    "report.json", "report.md", "predictions.jsonl", "reliability.png")


def read_eval_rows(paths: Sequence[str]) -> list[dict[str, Any]]:
    from hobson.corpus.schema import read_rows

    rows: list[dict[str, Any]] = []
    for p in paths:
        rows.extend(read_rows(p))
    return rows


def _round(x: Any) -> Any:
    """Six significant digits (not decimals: a p-value of 1e-20 must not print as 0)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


def short_path(path: str) -> str:
    """The last two components (``build/eval.jsonl``, ``R/calibrated``): no absolute paths in reports."""
    parts = Path(path).parts
    return "/".join(parts[-2:])


def grouped(probs: Sequence[Sequence[float]], rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, dict]:
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(str(r[key]), []).append(i)
    return {g: metrics.summary([probs[i] for i in idx], [rows[i]["label"] for i in idx])
            for g, idx in sorted(groups.items())}


def pairs_of(rows: Sequence[Mapping[str, Any]], path: str) -> list[tuple[int, int]]:
    """Row positions of each ``pair`` id (exactly two rows each), in pair-id order."""
    by_pair: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if "pair" not in r:
            raise DataError(f"{path}:{i + 1}: a paired-set row needs a \"pair\" key")
        by_pair.setdefault(int(r["pair"]), []).append(i)
    bad = [p for p, idx in by_pair.items() if len(idx) != 2]
    if bad:
        raise DataError(f"{path}: pair {bad[0]} has {len(by_pair[bad[0]])} rows; every pair needs exactly two")
    return [tuple(by_pair[p]) for p in sorted(by_pair)]  # type: ignore[misc]


def paired_report(probs: Sequence[Sequence[float]], rows: Sequence[Mapping[str, Any]], path: str) -> dict:
    pairs = pairs_of(rows, path)
    preds = [metrics.argmax(p) for p in probs]
    same = sum(preds[a] == preds[b] for a, b in pairs)
    both = sum(preds[a] == rows[a]["label"] and preds[b] == rows[b]["label"] for a, b in pairs)
    n = len(pairs)
    return {"pairs": n, "agreement": same / n if n else 0.0, "changed": (n - same) / n if n else 0.0,
            "both_correct": both / n if n else 0.0,
            "accuracy": metrics.accuracy(probs, [r["label"] for r in rows])}


def model_probs(loaded: LoadedDecider, rows: Sequence[Mapping[str, Any]], batch_size: int) -> list[list[float]]:
    return probabilities(predict_logits(loaded, rows, batch_size), rows, loaded.temperatures)


def evaluate(loaded: LoadedDecider, eval_files: Sequence[str], *, half: str = "test",
             catchall: str | None = None, consistency: str | None = None, flip: str | None = None,
             batch_size: int = 32, bins: int = 10) -> tuple[dict, list[dict]]:
    """``(report, prediction lines)`` for one loaded checkpoint (see the module docstring)."""
    all_rows = read_eval_rows(eval_files)
    positions = split_half(len(all_rows), half)
    rows = [all_rows[k] for k in positions]
    if not rows:
        raise DataError(f"no rows to evaluate in {', '.join(eval_files)} (half {half})")
    probs = model_probs(loaded, rows, batch_size)
    labels = [r["label"] for r in rows]
    report: dict[str, Any] = {
        "checkpoint": short_path(loaded.path),
        "temperatures": {k: loaded.temperatures.get(k) for k in ("global", "per_kind")},
        "eval_files": [short_path(p) for p in eval_files],
        "half": half,
        "overall": metrics.summary(probs, labels, bins),
        "per_kind": grouped(probs, rows, "kind"),
        "per_task": grouped(probs, rows, "task"),
        "confidence_bands": metrics.confidence_bands(probs, labels),
        "reliability": metrics.reliability_bins(probs, labels, bins),
    }
    if catchall:
        c_rows = read_eval_rows([catchall])
        report["catchall"] = metrics.summary(model_probs(loaded, c_rows, batch_size), [r["label"] for r in c_rows])
    for name, path in (("consistency", consistency), ("flip", flip)):
        if path:
            p_rows = read_eval_rows([path])
            report[name] = paired_report(model_probs(loaded, p_rows, batch_size), p_rows, path)
    predictions = [{"index": k, "task": r["task"], "kind": r["kind"], "label": r["label"],
                    "pred": metrics.argmax(p), "probs": [round(x, 6) for x in p]}
                   for k, r, p in zip(positions, rows, probs, strict=True)]
    return _round(report), predictions


def format_table(report: Mapping[str, Any]) -> str:
    """Markdown: overall, per kind, per task, confidence bands and the paired sets."""
    head = ("| group | rows | accuracy | majority | p (beats majority) | NLL | ECE | Brier |\n"
            "|---|---|---|---|---|---|---|---|")

    def line(name: str, s: Mapping[str, Any]) -> str:
        return (f"| {name} | {s['rows']} | {s['accuracy']:.4f} | {s['majority_accuracy']:.4f} | "
                f"{s['p_beats_majority']:.3g} | {s['nll']:.4f} | {s['ece']:.4f} | {s['brier']:.4f} |")

    out = [f"# Evaluation of {report['checkpoint']}", "",
           f"Half `{report['half']}` of {', '.join(report['eval_files'])}; temperatures "
           f"{report['temperatures']}.", "", "## Overall", "", head, line("all", report["overall"]), "",
           "## Per kind", "", head, *[line(k, s) for k, s in report["per_kind"].items()], "",
           "## Per task", "", head, *[line(k, s) for k, s in report["per_task"].items()], "",
           "## Confidence bands", "", "| band | rows | share | accuracy |", "|---|---|---|---|"]
    for b in report["confidence_bands"]:
        acc = "-" if b["accuracy"] is None else f"{b['accuracy']:.4f}"
        out.append(f"| {b['band']} | {b['rows']} | {b['share']:.4f} | {acc} |")
    if "catchall" in report:
        out += ["", "## Catch-all set", "", head, line("catchall", report["catchall"])]
    for name, what in (("consistency", "agreement"), ("flip", "changed")):
        if name in report:
            r = report[name]
            out += ["", f"## {name.capitalize()} pairs", "",
                    f"{r['pairs']} pairs: {what} {r[what]:.4f}, both correct {r['both_correct']:.4f}, "
                    f"accuracy {r['accuracy']:.4f}"]
    return "\n".join(out) + "\n"


def write_report(out_dir: str | os.PathLike, report: Mapping[str, Any], predictions: Sequence[Mapping[str, Any]],
                 plot: bool = True) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report_json": out / REPORT_JSON, "report_md": out / REPORT_MD, "predictions": out / PREDICTIONS}
    with atomic_write(paths["predictions"]) as f:
        for p in predictions:
            f.write(dumps_row(p) + "\n")
    if plot:
        from hobson.decider.plots import reliability_diagram

        paths["reliability"] = out / RELIABILITY_PNG
        reliability_diagram(report["reliability"], paths["reliability"],
                            title=f"{Path(str(report['checkpoint'])).name}: ECE {report['overall']['ece']:.3f}")
    write_text_atomic(paths["report_md"], format_table(report))
    write_json_atomic(paths["report_json"], report)  # last: its presence means the others are complete
    return paths


def evaluate_checkpoint(checkpoint: str, eval_files: Sequence[str], out_dir: str, *, device: str = "cpu",
                        base_model: str | None = None, plot: bool = True, **kwargs: Any) -> dict:
    loaded = load_decider(checkpoint, device, base_model)
    report, predictions = evaluate(loaded, eval_files, **kwargs)
    write_report(out_dir, report, predictions, plot)
    return report
