"""RL objectives and advantage estimators as small pure functions, looked up by name.

One RL loop serves every algorithm: it looks up an advantage estimator and an objective by
name (``get_advantage``, ``get_objective``) and never branches on the algorithm itself.

Shapes: ``B`` sequences (completions), ``T`` token positions, ``V`` vocabulary. Every per-token
tensor is ``(B, T)`` and comes with ``mask`` ``(B, T)`` (1 for response tokens that count, 0 for
prompt and padding). Sequence rewards are ``(B,)``.

Every objective returns ``(loss, metrics)``: ``loss`` is a 0-d tensor that carries the gradient,
reduced over the mask as :func:`aggregate` says (by default VIME's: each sequence's token mean,
then the mean over the step's sequences); ``metrics`` maps names to detached 0-d tensors reduced
the same way. Every objective reports ``clipfrac``, ``ratio_mean`` and ``approx_kl``, the k1
estimate ``log π_old - log π_θ`` of KL(π_old || π_θ) (VIME's ``ppo_kl``). docs/RL.md maps each
convention to the reference function it matches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from hobson.errors import ConfigError

# Re-exported: the trainer's forward passes (hobson.rl.algorithms, hobson.rl.loop) take their
# log-probs from here beside the losses they feed; defined below rollout/ so the engines share them.
from hobson.models.logprobs import tempered_logprobs as tempered_logprobs
from hobson.models.logprobs import token_logprobs as token_logprobs

F = TypeVar("F", bound=Callable[..., Any])

_OBJECTIVES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}
_ADVANTAGES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {}

# Which estimator each algorithm uses by default. Every algorithm except GRPO trains a critic
# (issue 5: "checkpoint actor (and critic, except GRPO)"), so they use GAE.
DEFAULT_ADVANTAGE: dict[str, str] = {"ppo": "gae", "grpo": "grpo", "dppo": "gae", "flow-dppo": "gae"}


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        if name in table:
            raise ValueError(
                f"{kind} {name!r} is already registered (by {table[name].__qualname__}); pick another name"
            )
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict[str, Any], kind: str, name: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; supported: {', '.join(sorted(table))}") from None


def register_objective(name: str) -> Callable[[F], F]:
    """Register a policy objective under ``name``; a taken name raises ValueError."""
    return _register(_OBJECTIVES, "objective", name)


def register_advantage(name: str) -> Callable[[F], F]:
    """Register an advantage estimator under ``name``; a taken name raises ValueError."""
    return _register(_ADVANTAGES, "advantage estimator", name)


def get_objective(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The objective registered as ``name``; an unknown name raises ConfigError listing the supported ones."""
    return _lookup(_OBJECTIVES, "objective", name)


def get_advantage(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The estimator registered as ``name``; an unknown name raises ConfigError listing the supported ones."""
    return _lookup(_ADVANTAGES, "advantage estimator", name)


def supported_objectives() -> list[str]:
    return sorted(_OBJECTIVES)


def supported_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


# ---------------------------------------------------------------------------------------------
# Aggregation and masked statistics


AGGREGATIONS = ("sample-mean", "token-mean")


def aggregate(loss_tokens: Tensor, mask: Tensor, mode: str = "sample-mean") -> Tensor:
    """Reduce per-token values ``(B, T)`` over ``mask`` to one number.

    ``sample-mean`` (VIME's ``cp_utils.get_sum_of_sample_mean`` over the step's rollouts): each
    sequence's masked token mean, then the mean over the ``B`` sequences, so a long completion
    weighs as much as a short one; a sequence with no valid token adds 0 and still counts.
    ``token-mean`` (verl's "token-mean"): ``Σ loss·mask / Σ mask``, every valid token alike.
    With no valid token the result is 0 and still carries a gradient path.
    """
    mask = mask.to(loss_tokens.dtype)
    if mode == "sample-mean":
        per_seq = (loss_tokens * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / max(per_seq.numel(), 1)
    if mode == "token-mean":
        return (loss_tokens * mask).sum() / mask.sum().clamp(min=1.0)
    raise ConfigError(f"loss_aggregation {mode!r}: supported {', '.join(AGGREGATIONS)}")


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - μ) / sqrt(σ² + eps)`` with μ, σ² the masked mean and unbiased variance; 0 off the mask.

    ``x``, ``mask``: ``(B, T)``. With fewer than two valid entries the variance is taken as 0.
    """
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1.0)
    var = (((x - mean) ** 2) * m).sum() / (n - 1).clamp(min=1.0)
    return (x - mean) * torch.rsqrt(var + eps) * m


def _detached(**values: Tensor) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in values.items()}


def _k1(log_ratio: Tensor) -> Tensor:
    # k1 estimator of KL(old || θ) from log r = log π_θ - log π_old: -log r per token (VIME's
    # ppo_kl = old - new); unbiased for samples from π_old, negative on single tokens
    return -log_ratio


# ---------------------------------------------------------------------------------------------
# Advantage estimators. Common signature:
#   fn(rewards (B,), mask (B, T), *, values=None, group_ids=None, span=None, <params>)
#       -> (advantages, returns)
# with advantages and returns of shape (B, T), zero off the mask. An estimator ignores the inputs
# it does not use and raises ValueError when one it needs is missing.


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence reward on its last valid token.

    ``rewards``: ``(B,)``; ``mask``: ``(B, T)``. Returns ``(B, T)`` with ``rewards[b]`` at the last
    ``t`` where ``mask[b, t] == 1`` and 0 elsewhere (a row with no valid token gets nothing).
    """
    B, T = mask.shape
    valid = mask.bool()
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)  # (B,)
    out = torch.zeros(B, T, dtype=rewards.dtype, device=rewards.device)
    has = last >= 0
    out[has.nonzero(as_tuple=True)[0], last[has]] = rewards[has]
    return out


def response_span(positions: Tensor) -> Tensor:
    """``(B, T)`` 0/1: from each row's first to its last marked position, holes filled."""
    T = positions.shape[-1]
    idx = torch.arange(T, device=positions.device).expand_as(positions)
    marked = positions.bool()
    first = torch.where(marked, idx, torch.full_like(idx, T)).amin(dim=-1, keepdim=True)
    last = torch.where(marked, idx, torch.full_like(idx, -1)).amax(dim=-1, keepdim=True)
    return ((idx >= first) & (idx <= last)).to(positions.dtype)


GAE_MASKED = ("span", "skip")


@register_advantage("gae")
def gae_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    span: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    masked: str = "span",
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438, eqn 16).

    Over the positions of a row's recursion, with ``V_{t+1} = 0`` after the last one::

        δ_t = r_t + γ·V_{t+1} - V_t,     A_t = δ_t + γλ·A_{t+1},     R_t = A_t + V_t

    ``masked="span"`` (VIME's ``compute_advantages_and_returns`` → ``vanilla_gae``): the
    recursion runs over every position of the row's response span (first to last response
    position, ``span``; default: the span of ``mask``), masked ones included, and the reward sits
    on the span's last position even when that one is masked; nothing outside the span (prompt,
    right padding) enters. The loss mask only selects what is whitened (and, in the objectives,
    what enters the loss): before whitening ``A`` and ``R`` hold the recursion's values on the
    whole span. ``masked="skip"`` (hobson before conventions v2): the recursion carries over
    masked positions and the reward sits on the last valid token; ``A``, ``R`` are 0 off the mask.

    ``whiten``: advantages whitened over the valid tokens of the batch (:func:`masked_whiten`,
    0 off the mask). ``rewards (B,)``; ``values``, ``mask``, ``span`` ``(B, T)``; returns
    ``(advantages, returns)``, both ``(B, T)``, detached. ``group_ids`` is ignored.
    """
    if values is None:
        raise ValueError("gae needs critic values (B, T); pass values=")
    if masked not in GAE_MASKED:
        raise ConfigError(f"gae_masked {masked!r}: supported {', '.join(GAE_MASKED)}")
    del group_ids
    with torch.no_grad():
        m = mask.to(values.dtype)
        # the positions the recursion runs over: the span, or (skip) the valid tokens only
        run = response_span(m if span is None else span.to(values.dtype)) if masked == "span" else m
        r = last_token_rewards(rewards.to(values.dtype), run)
        B, T = values.shape
        next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
        next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)
        adv = torch.zeros_like(values)
        for t in reversed(range(T)):
            delta = r[:, t] + gamma * next_value - values[:, t]
            a = delta + gamma * lam * next_adv
            adv[:, t] = a * run[:, t]
            # off the run (right padding, or a skipped hole) keep what the position before sees
            next_adv = torch.where(run[:, t] > 0, a, next_adv)
            next_value = torch.where(run[:, t] > 0, values[:, t], next_value)
        returns = (adv + values) * run
        if whiten:
            adv = masked_whiten(adv, mask)
    return adv, returns


@register_advantage("grpo")
def grpo_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    span: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Group-normalised outcome advantages (GRPO, DeepSeekMath, arXiv 2402.03300, §4.1.2).

    For the completions ``i`` of one prompt group ``g``::

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        std unbiased (n - 1)

    broadcast to every valid token of completion ``i``. A group whose rewards are all equal gets
    exactly 0 (set explicitly: a float mean of equal numbers can differ from them in the last
    bit, which would leave tiny non-zero advantages). ``rewards (B,)``, ``group_ids (B,)``
    integer, ``mask (B, T)``; each group needs at least two completions. Returns
    ``(advantages, returns)`` with ``returns = advantages`` (there is no critic); ``values`` and
    ``span`` are ignored.
    """
    if group_ids is None:
        raise ValueError("grpo needs group_ids (B,): which prompt each completion answers")
    del values, span
    with torch.no_grad():
        r = rewards.to(torch.float32 if not rewards.is_floating_point() else rewards.dtype)
        _, gid = torch.unique(group_ids, return_inverse=True)
        G = int(gid.max()) + 1 if gid.numel() else 0
        count = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, gid, torch.ones_like(r))
        if G and bool((count < 2).any()):
            raise ValueError("grpo needs at least 2 completions per prompt group")
        mean = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, gid, r) / count
        dev = r - mean[gid]
        var = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, gid, dev * dev) / (count - 1)
        std = var.sqrt()
        gmax = torch.full((G,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, gid, r, "amax")
        gmin = torch.full((G,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, gid, r, "amin")
        seq_adv = torch.where((gmax == gmin)[gid], torch.zeros_like(r), dev / (std[gid] + eps))
        adv = seq_adv[:, None] * mask.to(r.dtype)
    return adv, adv


# ---------------------------------------------------------------------------------------------
# Objectives


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_eps: float) -> tuple[Tensor, Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


def _ppo_clip(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float, aggregation: str
) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    loss_tokens, was_clipped = _clipped_surrogate(ratio, advantages.detach(), clip_eps)
    loss = aggregate(loss_tokens, mask, aggregation)
    metrics = _detached(
        clipfrac=aggregate(was_clipped.to(ratio.dtype), mask, aggregation),
        ratio_mean=aggregate(ratio, mask, aggregation),
        approx_kl=aggregate(_k1(log_ratio), mask, aggregation),
    )
    return loss, metrics


@register_objective("ppo")
def ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    aggregation: str = "sample-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, eqn 7), as a loss::

        r_t = exp(log π_θ(a_t) - log π_old(a_t))
        L   = aggregate over valid t of  max(-r_t·A_t, -clip(r_t, 1-ε, 1+ε)·A_t)

    ``π_old`` is the rollout (behaviour) policy's log-prob of the sampled token (VIME's
    ``--use-rollout-logprobs``). All inputs ``(B, T)``; ``logprobs`` carries the gradient, the
    others are treated as constants. ``clipfrac``: where the clipped branch is strictly larger
    (VIME's ``pg_clipfrac``). The critic's loss is :func:`value_loss`; GAE gives the advantages.
    """
    return _ppo_clip(logprobs, old_logprobs, advantages, mask, clip_eps, aggregation)


@register_objective("grpo")
def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    aggregation: str = "sample-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO policy loss (DeepSeekMath, arXiv 2402.03300, eqn 3 without the KL term).

    The same clipped surrogate as :func:`ppo_loss` (ratio against the rollout log-probs,
    ε = 0.2), driven by group-normalised advantages (:func:`grpo_advantages`) and no critic.
    All inputs ``(B, T)``. Zero advantages give exactly zero loss and zero gradient.
    """
    return _ppo_clip(logprobs, old_logprobs, advantages, mask, clip_eps, aggregation)


@register_objective("dppo")
def dppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    weight_min: float = 0.5,
    weight_max: float = 2.0,
    aggregation: str = "sample-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization",
    arXiv 2110.00641, eqn 2), with the behaviour correction clamped (VIME's ``--use-tis
    --tis-clip-low 0.5 --tis-clip 2``)::

        r_t = exp(log π_θ(a_t) - log π_prox(a_t))
        w_t = clamp(exp(log π_prox(a_t) - log π_behav(a_t)), 0.5, 2)
        L   = aggregate over valid t of  max(-r_t·A_t, -clip(r_t, 1-ε, 1+ε)·A_t) · w_t

    ``π_prox``: the trainer's log-probs of the sampled tokens recomputed just before the update;
    ``π_behav``: the rollout engine's. All inputs ``(B, T)``; only ``logprobs`` carries a
    gradient. Metrics add ``weight_mean`` (VIME's ``tis``: the mean of the raw, unclamped
    weight) and ``weight_clampfrac`` (``tis_clipfrac``: where the clamp changed it).
    """
    prox = prox_logprobs.detach()
    log_ratio = logprobs - prox
    ratio = torch.exp(log_ratio)
    raw_w = torch.exp(prox - behav_logprobs.detach())
    weight = raw_w.clamp(weight_min, weight_max)
    surrogate, was_clipped = _clipped_surrogate(ratio, advantages.detach(), clip_eps)
    loss = aggregate(surrogate * weight, mask, aggregation)
    metrics = _detached(
        clipfrac=aggregate(was_clipped.to(ratio.dtype), mask, aggregation),
        ratio_mean=aggregate(ratio, mask, aggregation),
        approx_kl=aggregate(_k1(log_ratio), mask, aggregation),
        weight_mean=aggregate(raw_w, mask, aggregation),
        weight_clampfrac=aggregate((weight != raw_w).to(ratio.dtype), mask, aggregation),
    )
    return loss, metrics


def entropy(logprobs_full: Tensor) -> Tensor:
    """Per-token entropy ``-Σ_v p(v) log p(v)``: ``(B, T, V) -> (B, T)`` (reduce it with :func:`aggregate`)."""
    return -(logprobs_full.exp() * logprobs_full).sum(dim=-1)


@register_objective("flow-dppo")
def flow_dppo_loss(
    logprobs_full: Tensor,
    old_logprobs_full: Tensor,
    actions: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kl_budget: float = 0.01,
    aggregation: str = "sample-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-DPPO: an unclipped policy gradient whose outward moves are gated by a per-token KL
    (VIME's ``vime_plugins/flow_dppo/loss.py:categorical_flow_dppo``).

    From the full-vocabulary log-probs ``log p(v) = log_softmax(logits / T)`` of the frozen old
    policy (computed once before the update) and of π_θ::

        D_t = max(0, Σ_v p_old(v) · (log p_old(v) - log p_θ(v)))     categorical KL(old || θ)
        ℓ_t = log p_θ(a_t) - log p_old(a_t),   ρ_t = exp(ℓ_t)
        blocked_t = ((A_t > 0 ∧ ℓ_t > 0) ∨ (A_t < 0 ∧ ℓ_t < 0)) ∧ D_t > kl_budget
        L   = aggregate over valid t of  -ρ̃_t · A_t,   ρ̃_t = stopgrad(ρ_t) if blocked_t else ρ_t

    "Outward" is read from the sign of the log-ratio, not from ``ρ > 1``: a float32 log-ratio of
    6e-8 rounds ρ to exactly 1.0 and must still count. ``D`` is clamped at 0 (rounding can make
    an identical policy's KL slightly negative). A blocked token keeps its loss value but gives
    no gradient, so the policy cannot move further away where it already spent its KL budget
    (0.01); moves back toward the old policy are never blocked.

    Shapes: ``logprobs_full``, ``old_logprobs_full`` ``(B, T, V)``; ``actions`` (sampled token
    ids), ``advantages``, ``mask`` ``(B, T)``. Metrics: ``gate_frac`` (blocked share; also
    ``clipfrac``), ``kl_mean`` (mean D, VIME's ``categorical_kl``) and ``approx_kl`` (k1 of the
    selected tokens, VIME's ``ppo_kl``).
    """
    old = old_logprobs_full.detach()
    idx = actions.long().unsqueeze(-1)
    log_ratio = logprobs_full.gather(-1, idx).squeeze(-1) - old.gather(-1, idx).squeeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    with torch.no_grad():
        kl = (old.exp() * (old - logprobs_full)).sum(dim=-1).clamp_min(0.0)  # (B, T)
        outward = ((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0))
        blocked = outward & (kl > kl_budget)
    gated_ratio = torch.where(blocked, ratio.detach(), ratio)
    loss = aggregate(-gated_ratio * adv, mask, aggregation)
    gate_frac = aggregate(blocked.to(ratio.dtype), mask, aggregation)
    metrics = _detached(
        clipfrac=gate_frac,
        gate_frac=gate_frac,
        ratio_mean=aggregate(ratio, mask, aggregation),
        approx_kl=aggregate(_k1(log_ratio), mask, aggregation),
        kl_mean=aggregate(kl, mask, aggregation),
    )
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    value_clip: float = 0.2,
    aggregation: str = "sample-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss (VIME's ``loss.py:value_loss_function``; PPO2 baselines)::

        V_clip = V_old + clip(V - V_old, -c, c)
        L      = aggregate over valid t of  max((V_clip - R)², (V - R)²)      (no ½)

    ``values`` (the critic now, with gradient), ``old_values`` (the critic at rollout time),
    ``returns`` (GAE targets) and ``mask``: ``(B, T)``. Metrics: ``vf_clipfrac`` (where
    ``|V - V_old| > c``, VIME's ``value_clipfrac``) and ``value_mean``.
    """
    old = old_values.detach()
    target = returns.detach()
    clipped = old + (values - old).clamp(-value_clip, value_clip)
    loss = aggregate(torch.maximum((clipped - target) ** 2, (values - target) ** 2), mask, aggregation)
    metrics = _detached(
        vf_clipfrac=aggregate(((values - old).abs() > value_clip).to(values.dtype), mask, aggregation),
        value_mean=aggregate(values, mask, aggregation),
    )
    return loss, metrics
