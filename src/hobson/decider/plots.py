"""Plots written as PNG with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from hobson.io import atomic_write


def reliability_diagram(bins: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """Accuracy against confidence per bin (bars), the diagonal, and the rows per bin (inset text).

    The PNG carries no timestamp (``metadata={"Software": None}`` drops matplotlib's version tag),
    so the same bins give the same bytes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    try:
        width = bins[0]["hi"] - bins[0]["lo"] if bins else 0.1
        for b in bins:
            if not b["rows"]:
                continue
            ax.bar(b["lo"], b["accuracy"], width=width, align="edge", color="#4c72b0", edgecolor="black")
            ax.bar(b["lo"], b["confidence"] - b["accuracy"], bottom=b["accuracy"], width=width, align="edge",
                   color="#dd8452", alpha=0.4, edgecolor="none")
            ax.text(b["lo"] + width / 2, 0.02, str(b["rows"]), ha="center", fontsize=7, rotation=90)
        ax.plot([0, 1], [0, 1], "k--", linewidth=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence (max probability)")
        ax.set_ylabel("accuracy")
        ax.set_title(title or "reliability")
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
