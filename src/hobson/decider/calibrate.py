"""Temperature calibration on a held-out half of the evaluation rows.

The evaluation rows (the eval files concatenated in the given order) are split by position:
row ``k`` belongs to the *calibration half* when ``k`` is even and to the *test half* when ``k``
is odd (:func:`split_half`). Calibration fits on the first, evaluation reports on the second, so
no row both sets a temperature and scores it.

Fitting: one global temperature ``T`` minimising the mean NLL of ``softmax(z / T)`` over the
calibration half; then, for every kind with at least ``min_kind_rows`` rows there, a temperature
of its own fitted on that kind's rows (kinds with fewer rows use the global one). The NLL is
convex in ``beta = 1/T``, so a golden-section search over ``beta`` in ``[1/T_MAX, 1/T_MIN]``
finds the minimum; it is deterministic and needs no gradient.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hobson.decider.checkpoint import load_checkpoint, save_checkpoint

T_MIN, T_MAX = 0.05, 20.0
DEFAULT_MIN_KIND_ROWS = 100
HALVES = ("calib", "test", "all")
_GOLDEN = (math.sqrt(5) - 1) / 2


def split_half(n_rows: int, half: str) -> list[int]:
    """Positions of ``half`` (``calib``: even, ``test``: odd, ``all``) among ``n_rows`` rows."""
    if half == "calib":
        return list(range(0, n_rows, 2))
    if half == "test":
        return list(range(1, n_rows, 2))
    if half == "all":
        return list(range(n_rows))
    raise ValueError(f"half {half!r} is not one of {', '.join(HALVES)}")


def mean_nll(logits: Sequence[Sequence[float]], labels: Sequence[int], temperature: float) -> float:
    """Mean ``-log softmax(z / T)[y]`` (log-sum-exp, float64)."""
    total = 0.0
    for z, y in zip(logits, labels, strict=True):
        s = [x / temperature for x in z]
        m = max(s)
        total += m + math.log(sum(math.exp(x - m) for x in s)) - s[y]
    return total / len(labels)


def fit_temperature(logits: Sequence[Sequence[float]], labels: Sequence[int], iterations: int = 80) -> float:
    """The temperature in ``[T_MIN, T_MAX]`` minimising :func:`mean_nll` (golden section on 1/T)."""
    if not labels:
        return 1.0
    lo, hi = 1.0 / T_MAX, 1.0 / T_MIN
    a = hi - _GOLDEN * (hi - lo)
    b = lo + _GOLDEN * (hi - lo)
    fa, fb = mean_nll(logits, labels, 1 / a), mean_nll(logits, labels, 1 / b)
    for _ in range(iterations):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - _GOLDEN * (hi - lo)
            fa = mean_nll(logits, labels, 1 / a)
        else:
            lo, a, fa = a, b, fb
            b = lo + _GOLDEN * (hi - lo)
            fb = mean_nll(logits, labels, 1 / b)
    beta = (lo + hi) / 2
    # Keep T = 1 when it is as good: a well-calibrated model keeps its raw outputs.
    if mean_nll(logits, labels, 1.0) <= mean_nll(logits, labels, 1 / beta):
        return 1.0
    return round(1 / beta, 6)


def fit_temperatures(logits: Sequence[Sequence[float]], rows: Sequence[Mapping[str, Any]],
                     min_kind_rows: int = DEFAULT_MIN_KIND_ROWS) -> dict[str, Any]:
    """``{"global": T, "per_kind": {...}, "calibration": {...}}`` fitted on these rows."""
    labels = [int(r["label"]) for r in rows]
    t_global = fit_temperature(logits, labels)
    per_kind: dict[str, float] = {}
    kind_rows: dict[str, int] = {}
    for kind in sorted({r["kind"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["kind"] == kind]
        kind_rows[kind] = len(idx)
        if len(idx) >= min_kind_rows:
            per_kind[kind] = fit_temperature([logits[i] for i in idx], [labels[i] for i in idx])
    temps = {"global": t_global, "per_kind": per_kind}
    after = sum(mean_nll([logits[i]], [labels[i]], per_kind.get(rows[i]["kind"], t_global))
                for i in range(len(rows))) / len(rows) if rows else 0.0
    temps["calibration"] = {
        "rows": len(rows),
        "rows_per_kind": kind_rows,
        "min_kind_rows": min_kind_rows,
        "nll_before": round(mean_nll(logits, labels, 1.0), 6) if rows else 0.0,
        "nll_after": round(after, 6),
    }
    return temps


def write_temperatures(checkpoint: str | os.PathLike, temperatures: Mapping[str, Any],
                       out: str | os.PathLike | None = None) -> Path:
    """Write ``temperatures`` into ``checkpoint`` in place (one atomic file), or into a copy at ``out``.

    The copy is a whole checkpoint directory written atomically (config, adapter, head and the new
    temperatures), so a later stage can depend on it without the training stage's output changing.
    """
    if out is None:
        # the whole directory again (atomically), so its manifest covers the new temperatures
        path = Path(checkpoint)
        ckpt = load_checkpoint(path)
        save_checkpoint(path, config=ckpt.config, adapter=ckpt.adapter, head=ckpt.head,
                        temperatures=dict(temperatures), trainer_state=ckpt.trainer_state)
        return path
    ckpt = load_checkpoint(checkpoint, trainer_state=False)
    save_checkpoint(out, config=ckpt.config, adapter=ckpt.adapter, head=ckpt.head,
                    temperatures=dict(temperatures))
    return Path(out)
