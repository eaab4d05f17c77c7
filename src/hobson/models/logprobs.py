"""Log-probabilities of sampled tokens under ``log_softmax(logits / T)``.

The rollout engines record them as behaviour log-probs while they sample, and the trainer
recomputes them for π_θ and π_old. Both sides call these same functions so that an engine and the
trainer scoring identical logits get identical bits. That is why they live here, below both
:mod:`hobson.rollout` and :mod:`hobson.rl`, and not with the objectives.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _at_least_fp32(x: Tensor) -> Tensor:
    # fp16/bf16 logits are promoted; fp64 (tests) stays fp64
    return x.to(torch.promote_types(x.dtype, torch.float32))


def tempered_logprobs(logits: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / T)`` over the vocabulary, at least fp32: ``(B, T, V) -> (B, T, V)``.

    Flow-DPPO freezes this for the old policy before the update and recomputes it for π_θ.
    """
    return torch.log_softmax(_at_least_fp32(logits) / temperature, dim=-1)


def token_logprobs(logits: Tensor, actions: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / T)[a]`` of the chosen tokens, at least fp32: ``(B, T, V), (B, T) -> (B, T)``.

    ``logits[:, t]`` must already be the distribution that produced ``actions[:, t]`` (shift
    before calling). Computed as gathered logit minus logsumexp, without a (B, T, V) log-prob copy.
    """
    scaled = _at_least_fp32(logits) / temperature
    picked = scaled.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)
