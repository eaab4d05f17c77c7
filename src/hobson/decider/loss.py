"""The decider loss: weighted cross-entropy, teacher KL and the frozen-torso KL anchor.

All tensors here are in *canonical* option order (the order of the corpus file, of ``label`` and
of the teacher's ``probs``); the collator's per-draw shuffle is undone before the loss
(:func:`hobson.decider.collate.to_canonical`). Shapes: ``B`` rows, ``N`` the widest row's option
count; ``mask[b, j]`` is true for the ``n_b`` real options ``j < n_b``.

For row ``b`` with model distribution ``p = softmax(z)`` over its options:

    loss_b = w_b * CE(y_b, p) + lambda_t * [has teacher] * KL_dir(t_b, p) + lambda_f * KL_dir(f_b, p)

- ``CE(y, p) = -sum_j y_j log p_j``. For ``noul`` and ``choice`` rows ``y`` is one-hot on the label.
  For ``score`` rows (ordinal options) ``y`` is *ordinally smoothed* with ``eps``: the label keeps
  ``1 - eps`` and ``eps`` goes to its neighbours in canonical order, ``eps / 2`` to each of
  ``label - 1`` and ``label + 1`` when both exist, all of ``eps`` to the one neighbour at either
  end, and nothing is smoothed for a one-option row (``y`` = one-hot).
- ``t_b`` is the teacher distribution, ``f_b = softmax(frozen logits)`` the frozen torso's
  option-letter readout (no gradient flows into either).
- ``KL_forward(q, p) = sum_j q_j (log q_j - log p_j)`` with ``0 log 0 = 0`` (mass-covering);
  ``KL_reverse(q, p) = sum_j p_j (log p_j - log q'_j)`` with ``q' = max(q, 1e-6) / sum max(q, 1e-6)``
  (mode-seeking; the floor keeps ``log q'`` finite where the target put zero mass).
- KL-only rows have ``w_b = 0``: their CE term is off, their KL terms are not.

:func:`decider_loss` returns the *sum* over rows; the recipe divides by the global number of
rows in the optimizer step (times the world size under DDP), so the gradient is the per-row mean
over the whole step whatever the world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KL_FLOOR = 1e-6


def ordinal_targets(label: torch.Tensor, n_options: torch.Tensor, width: int, eps: float,
                    is_score: torch.Tensor) -> torch.Tensor:
    """CE targets ``(B, width)``: one-hot, or ordinally smoothed for score rows (see module doc).

    Built by comparing column ids with the label, elementwise: an indexed write of a Python
    number (``y[rows, label] = 1.0``) copies that number from pageable host memory, which makes
    the host wait for the GPU once per write."""
    cols = torch.arange(width, device=label.device)
    at_label = (cols == label[:, None]).float()
    if eps <= 0:
        return at_label
    left = label - 1
    right = label + 1
    has_left = is_score & (left >= 0)
    has_right = is_score & (right < n_options)
    share = torch.where(has_left & has_right, eps / 2, eps)
    center = torch.where(has_left | has_right, 1.0 - eps, 1.0)
    # the three columns differ wherever their weight is not 0, so each sum is one exact term
    return (at_label * center[:, None]
            + (cols == left[:, None]).float() * torch.where(has_left, share, 0.0)[:, None]
            + (cols == right[:, None]).float() * torch.where(has_right, share, 0.0)[:, None])


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log softmax over the real options; padded slots hold 0 (never -inf, so 0 * logp stays 0)."""
    logp = F.log_softmax(logits.float().masked_fill(~mask, float("-inf")), dim=-1)
    return logp.masked_fill(~mask, 0.0)


def kl_rows(target: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, direction: str) -> torch.Tensor:
    """Per-row KL between a target distribution and the model's ``logp`` (both ``(B, N)``)."""
    target = target.float().masked_fill(~mask, 0.0)
    if direction == "forward":
        return (torch.xlogy(target, target) - target * logp).sum(-1)
    if direction == "reverse":
        floored = target.clamp(min=KL_FLOOR).masked_fill(~mask, 0.0)
        floored = floored / floored.sum(-1, keepdim=True)
        log_q = torch.log(floored.masked_fill(~mask, 1.0))
        p = logp.exp().masked_fill(~mask, 0.0)
        return (p * (logp - log_q)).sum(-1)
    raise ValueError(f"kl direction {direction!r} is not one of forward, reverse")


def decider_loss(
    logits: torch.Tensor,
    mask: torch.Tensor,
    label: torch.Tensor,
    is_score: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor | None = None,
    has_teacher: torch.Tensor | None = None,
    frozen_logits: torch.Tensor | None = None,
    *,
    score_eps: float = 0.1,
    kl_teacher_weight: float = 0.0,
    kl_frozen_weight: float = 0.0,
    kl_direction: str = "forward",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed loss over the rows and detached per-term sums (see the module docstring).

    ``logits``/``frozen_logits``/``teacher``: ``(B, N)`` canonical order; ``label``: ``(B,)``
    canonical index; ``weight``: ``(B,)`` row weights; ``has_teacher``: ``(B,)`` bool.
    Metrics: ``ce`` (weighted), ``kl_teacher``, ``kl_frozen`` (unweighted sums), ``correct``, ``rows``.
    """
    logp = masked_log_softmax(logits, mask)
    n_options = mask.sum(-1)
    y = ordinal_targets(label, n_options, logits.shape[1], score_eps, is_score)
    ce = -(y * logp).sum(-1)
    w = weight.float()
    total = (w * ce).sum()
    zero = torch.zeros((), device=logits.device)
    kl_t = zero
    if teacher is not None and has_teacher is not None and kl_teacher_weight > 0:
        # no "does any row have a teacher" branch: reading that back is a device sync per
        # micro-batch, and rows without one add exactly 0 (their teacher row is all zeros)
        kl_t = (kl_rows(teacher, logp, mask, kl_direction) * has_teacher.float()).sum()
        total = total + kl_teacher_weight * kl_t
    kl_f = zero
    if frozen_logits is not None and kl_frozen_weight > 0:
        frozen = torch.softmax(frozen_logits.detach().float().masked_fill(~mask, float("-inf")), dim=-1)
        kl_f = kl_rows(frozen, logp, mask, kl_direction).sum()
        total = total + kl_frozen_weight * kl_f
    pred = logits.detach().masked_fill(~mask, float("-inf")).argmax(-1)
    metrics = {
        "ce": (w * ce).sum().detach(),
        "kl_teacher": kl_t.detach(),
        "kl_frozen": kl_f.detach(),
        "correct": (pred == label).sum().float(),
        # a fill, not torch.tensor(...): that copies from pageable host memory, a sync on a GPU
        "rows": torch.full((), float(label.shape[0]), device=logits.device),
    }
    return total, metrics
