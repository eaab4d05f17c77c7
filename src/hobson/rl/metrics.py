"""Per-update metrics: one JSONL line per update and a PNG of the curves.

``<output>/metrics.jsonl`` rows hold ``update``, ``reward_mean``, ``approx_kl``, ``clipfrac``,
``gate_frac`` (Flow-DPPO), ``entropy``, ``tokens_per_s``, ``seconds`` per phase, and more. Timings
differ between runs, so ``verify-resume`` never compares this file. ``metrics.png`` is redrawn
at the end of every process. The same numbers go to TensorBoard event files in ``<output>/tb``
(:mod:`hobson.scalars`). Only rank 0 logs (there is one training process).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hobson.io import atomic_write, dumps_row
from hobson.scalars import TensorBoardLog

CURVES = ("reward_mean", "approx_kl", "clipfrac", "gate_frac", "entropy", "tokens_per_s")


class MetricsLog:
    def __init__(self, output: str | os.PathLike) -> None:
        self.jsonl = Path(output) / "metrics.jsonl"
        self.png = Path(output) / "metrics.png"
        self.tb_dir = Path(output) / "tb"
        self._tb: TensorBoardLog | None = None
        self._purge: int | None = None

    def _board(self) -> TensorBoardLog:
        if self._tb is None:
            self._tb = TensorBoardLog(self.tb_dir, purge_step=self._purge)
        return self._tb

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def rows(self) -> list[dict[str, Any]]:
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]

    def keep_until(self, update: int) -> None:
        """Drop rows past ``update`` (written after the last checkpoint of an interrupted run)."""
        rows = [r for r in self.rows() if r["update"] <= update]
        with atomic_write(self.jsonl) as f:
            for r in rows:
                f.write(dumps_row(r) + "\n")
        self._purge = update + 1  # TensorBoard drops the interrupted process's steps past it

    def append(self, row: dict[str, Any]) -> None:
        rows = self.rows() + [row]
        with atomic_write(self.jsonl) as f:
            for r in rows:
                f.write(dumps_row(r) + "\n")
        self._board().add(row["update"], row, skip=("update",))

    def plot(self, rows: list[dict[str, Any]] | None = None) -> None:
        """Draw ``metrics.png`` (at the end of each process: matplotlib takes seconds per figure)."""
        rows = self.rows() if rows is None else rows
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # one figure, one axes per curve, no tight_layout: text layout dominates matplotlib's time
        fig, axes = plt.subplots(len(CURVES), 1, figsize=(6, 1.6 * len(CURVES)), dpi=72, sharex=True)
        xs = [r["update"] for r in rows]
        for ax, key in zip(axes, CURVES, strict=True):
            pts = [(x, r.get(key)) for x, r in zip(xs, rows, strict=True) if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
            ax.set_ylabel(key, fontsize=8)
        axes[-1].set_xlabel("update")
        with atomic_write(self.png, "wb") as f:
            fig.savefig(f, format="png")
        plt.close(fig)
