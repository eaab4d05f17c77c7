"""Evaluation metrics and exact tests, as small pure functions on probabilities and labels.

For ``n`` rows with predicted distributions ``p_i`` (over row ``i``'s own options), labels
``y_i``, confidence ``c_i = max_j p_ij`` and prediction ``argmax_j p_ij`` (first index on ties):

- accuracy ``= (1/n) sum_i [argmax p_i = y_i]``
- NLL ``= -(1/n) sum_i log p_{i,y_i}`` (probabilities floored at 1e-12)
- Brier ``= (1/n) sum_i sum_j (p_ij - [j = y_i])^2`` (the multi-class Brier score, range 0..2)
- ECE ``= sum_b (n_b/n) |acc_b - conf_b|`` over ``bins`` equal-width confidence bins
  ``[0, 1/bins), ..., [1 - 1/bins, 1]`` (a confidence of exactly 1 falls in the last bin)
- majority-class baseline: the best *constant* predictor "always answer option position ``k``"
  chosen on the rows themselves, i.e. ``max_k (1/n) #{i: y_i = k}``. Choosing ``k`` on the
  evaluated rows makes it an upper bound on any constant predictor, so beating it is conservative.
- one-sided exact binomial test: ``P(X >= correct)`` for ``X ~ Binomial(n, baseline)``, summed
  in log space (no scipy needed).
- McNemar's exact test (two-sided) on paired predictions: with ``b`` = rows only A got right and
  ``c`` = rows only B got right, ``p = min(1, 2 P(X <= min(b, c)))`` for ``X ~ Binomial(b + c, 1/2)``
  (``p = 1`` when ``b + c = 0``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PROB_FLOOR = 1e-12
CONFIDENCE_BANDS = (0.0, 0.5, 0.7, 0.9, 1.0)


def argmax(p: Sequence[float]) -> int:
    best = 0
    for j in range(1, len(p)):
        if p[j] > p[best]:
            best = j
    return best


def accuracy(probs: Sequence[Sequence[float]], labels: Sequence[int]) -> float:
    return sum(argmax(p) == y for p, y in zip(probs, labels, strict=True)) / len(labels) if labels else 0.0


def nll(probs: Sequence[Sequence[float]], labels: Sequence[int]) -> float:
    if not labels:
        return 0.0
    return -sum(math.log(max(p[y], PROB_FLOOR)) for p, y in zip(probs, labels, strict=True)) / len(labels)


def brier(probs: Sequence[Sequence[float]], labels: Sequence[int]) -> float:
    if not labels:
        return 0.0
    total = 0.0
    for p, y in zip(probs, labels, strict=True):
        total += sum((pj - (1.0 if j == y else 0.0)) ** 2 for j, pj in enumerate(p))
    return total / len(labels)


def reliability_bins(probs: Sequence[Sequence[float]], labels: Sequence[int], bins: int = 10) -> list[dict]:
    """Per equal-width confidence bin: ``lo``, ``hi``, ``rows``, ``accuracy``, ``confidence``."""
    stats = [[0, 0.0, 0.0] for _ in range(bins)]  # rows, correct, summed confidence
    for p, y in zip(probs, labels, strict=True):
        c = max(p)
        b = min(int(c * bins), bins - 1)
        stats[b][0] += 1
        stats[b][1] += float(argmax(p) == y)
        stats[b][2] += c
    out = []
    for b, (n, correct, conf) in enumerate(stats):
        out.append({"lo": b / bins, "hi": (b + 1) / bins, "rows": n,
                    "accuracy": correct / n if n else None, "confidence": conf / n if n else None})
    return out


def ece(probs: Sequence[Sequence[float]], labels: Sequence[int], bins: int = 10) -> float:
    n = len(labels)
    if not n:
        return 0.0
    return sum(b["rows"] / n * abs(b["accuracy"] - b["confidence"])
               for b in reliability_bins(probs, labels, bins) if b["rows"])


def confidence_bands(probs: Sequence[Sequence[float]], labels: Sequence[int],
                     edges: Sequence[float] = CONFIDENCE_BANDS) -> list[dict]:
    """Rows, accuracy and share of rows per confidence band ``[lo, hi)`` (the last band closed)."""
    out = []
    n = len(labels)
    for k in range(len(edges) - 1):
        lo, hi = edges[k], edges[k + 1]
        last = k == len(edges) - 2
        sel = [(p, y) for p, y in zip(probs, labels, strict=True)
               if lo <= max(p) < hi or (last and max(p) == hi)]
        out.append({"band": f"[{lo:.2f}, {hi:.2f}{']' if last else ')'}", "rows": len(sel),
                    "share": len(sel) / n if n else 0.0,
                    "accuracy": sum(argmax(p) == y for p, y in sel) / len(sel) if sel else None})
    return out


def majority_baseline(labels: Sequence[int]) -> tuple[int, float]:
    """``(k, accuracy)`` of the best constant answer position on these rows (ties: smallest k)."""
    if not labels:
        return 0, 0.0
    counts: dict[int, int] = {}
    for y in labels:
        counts[y] = counts.get(y, 0) + 1
    k = min(counts, key=lambda c: (-counts[c], c))
    return k, counts[k] / len(labels)


def _log_binom_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p))


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    if m == -math.inf:
        return -math.inf
    return m + math.log(sum(math.exp(x - m) for x in xs))


def binomial_sf(k: int, n: int, p: float) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``, exact, summed in log space."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return min(1.0, math.exp(_logsumexp([_log_binom_pmf(j, n, p) for j in range(k, n + 1)])))


def binomial_cdf(k: int, n: int, p: float) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, p)``."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return min(1.0, math.exp(_logsumexp([_log_binom_pmf(j, n, p) for j in range(0, k + 1)])))


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict:
    """McNemar's exact two-sided test on paired correctness (see the module docstring)."""
    b = sum(1 for x, y in zip(a_correct, b_correct, strict=True) if x and not y)
    c = sum(1 for x, y in zip(a_correct, b_correct, strict=True) if y and not x)
    p = 1.0 if b + c == 0 else min(1.0, 2.0 * binomial_cdf(min(b, c), b + c, 0.5))
    return {"only_a": b, "only_b": c, "p_value": p}


def summary(probs: Sequence[Sequence[float]], labels: Sequence[int], bins: int = 10) -> dict:
    """Accuracy, NLL, Brier, ECE, the majority baseline and the binomial p that accuracy beats it."""
    n = len(labels)
    correct = sum(argmax(p) == y for p, y in zip(probs, labels, strict=True))
    k, base = majority_baseline(labels)
    return {
        "rows": n,
        "correct": correct,
        "accuracy": correct / n if n else 0.0,
        "nll": nll(probs, labels),
        "brier": brier(probs, labels),
        "ece": ece(probs, labels, bins),
        "majority_position": k,
        "majority_accuracy": base,
        "p_beats_majority": binomial_sf(correct, n, base) if n else 1.0,
    }
