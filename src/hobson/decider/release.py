"""The release route: seed checkpoints -> soup -> calibrate -> evaluate, and the steps' helpers.

``release(seeds, eval_files, out_dir)`` writes::

    <out_dir>/soup/          the soup checkpoint (temperatures reset to 1)
    <out_dir>/calibrated/    the soup with temperatures fitted on the calibration half
    <out_dir>/eval/          report.json, report.md, predictions.jsonl, reliability.png

Each step is the same function the single-purpose jobs call (``jobs.soup``, ``jobs.calibrate``,
``jobs.evaluate``), so the route is exactly those three jobs in a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hobson.decider.calibrate import DEFAULT_MIN_KIND_ROWS, fit_temperatures, split_half, write_temperatures
from hobson.decider.evaluate import read_eval_rows


def calibrate_checkpoint(checkpoint: str, eval_files: Sequence[str], *, out: str | None = None,
                         min_kind_rows: int = DEFAULT_MIN_KIND_ROWS, batch_size: int = 32, device: str = "cpu",
                         base_model: str | None = None) -> tuple[dict[str, Any], Path]:
    """Fit temperatures on the calibration half of ``eval_files``; write them (see calibrate)."""
    from hobson.decider.predict import load_decider, predict_logits

    loaded = load_decider(checkpoint, device, base_model)
    all_rows = read_eval_rows(eval_files)
    rows = [all_rows[k] for k in split_half(len(all_rows), "calib")]
    temps = fit_temperatures(predict_logits(loaded, rows, batch_size), rows, min_kind_rows)
    return temps, write_temperatures(checkpoint, temps, out)


def release(seed_checkpoints: Sequence[str], eval_files: Sequence[str], out_dir: str, *,
            catchall: str | None = None, consistency: str | None = None, flip: str | None = None,
            min_kind_rows: int = DEFAULT_MIN_KIND_ROWS, batch_size: int = 32, device: str = "cpu",
            plot: bool = True) -> dict[str, Any]:
    """Soup the seed checkpoints, calibrate the soup, evaluate it; returns the report."""
    from hobson.decider.evaluate import evaluate_checkpoint
    from hobson.decider.soup import soup_checkpoints

    out = Path(out_dir)
    soup_dir, calibrated, eval_dir = out / "soup", out / "calibrated", out / "eval"
    soup_checkpoints(seed_checkpoints, soup_dir)
    calibrate_checkpoint(str(soup_dir), eval_files, out=str(calibrated), min_kind_rows=min_kind_rows,
                         batch_size=batch_size, device=device)
    return evaluate_checkpoint(str(calibrated), eval_files, str(eval_dir), device=device, plot=plot,
                               catchall=catchall, consistency=consistency, flip=flip, batch_size=batch_size)
