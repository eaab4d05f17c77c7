"""Reference tests for hobson.rl.objectives: hand-computed cases and loop-vs-vectorized checks (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from hobson.errors import ConfigError
from hobson.rl import objectives as obj

SEEDS = [0, 1, 2]
SHAPES = [(2, 5), (4, 7), (6, 3)]


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------------------- registry


def test_registry_names_and_lookup_errors():
    assert obj.supported_objectives() == ["dppo", "flow-dppo", "grpo", "ppo"]
    assert obj.supported_advantages() == ["gae", "grpo"]
    assert obj.get_objective("ppo") is obj.ppo_loss
    assert obj.get_advantage("grpo") is obj.grpo_advantages
    supported = "supported: dppo, flow-dppo, grpo, ppo$"
    with pytest.raises(ConfigError, match=r"unknown objective 'reinforce'; " + supported):
        obj.get_objective("reinforce")
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'rloo'; supported: gae, grpo"):
        obj.get_advantage("rloo")
    with pytest.raises(ValueError, match="objective 'ppo' is already registered"):
        obj.register_objective("ppo")(lambda: None)
    with pytest.raises(ValueError, match="advantage estimator 'gae' is already registered"):
        obj.register_advantage("gae")(lambda: None)
    assert obj.get_objective("ppo") is obj.ppo_loss  # the failed registration changed nothing


def test_aggregate_sample_mean_default_and_token_mean():
    loss = t([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert obj.aggregate(loss, mask).item() == pytest.approx(2.25)  # ((1+2)/2 + 3) / 2
    assert obj.aggregate(loss, mask, "token-mean").item() == pytest.approx(2.0)  # (1+2+3)/3
    for mode in obj.AGGREGATIONS:
        assert obj.aggregate(loss, torch.zeros_like(mask), mode).item() == 0.0
    with pytest.raises(ConfigError, match="loss_aggregation 'seq-sum': supported sample-mean, token-mean"):
        obj.aggregate(loss, mask, "seq-sum")


# ------------------------------------------------------------------------------- hand cases


def test_ppo_hand_computed():
    # ratios 1.5, 0.5, 1.1 (and a masked token with huge values)
    logp = t([[math.log(1.5), math.log(0.5), math.log(1.1), 5.0]])
    old = t([[0.0, 0.0, 0.0, 0.0]])
    adv = t([[1.0, -1.0, 2.0, 9.0]])
    mask = t([[1, 1, 1, 0]])
    loss, m = obj.ppo_loss(logp, old, adv, mask, clip_eps=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped);
    # token 2: max(-2.2, -2.2) = -2.2 (not clipped)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    k1 = [-math.log(r) for r in (1.5, 0.5, 1.1)]  # VIME's ppo_kl: old - new
    assert m["approx_kl"].item() == pytest.approx(sum(k1) / 3)
    assert all(not v.requires_grad for v in m.values())
    # grpo is the same surrogate
    loss_g, _ = obj.grpo_loss(logp, old, adv, mask)
    assert loss_g.item() == loss.item()


def test_ppo_gradient_flows_only_through_unclipped_tokens():
    logp = t([[math.log(1.5), math.log(0.5), math.log(1.1)]]).requires_grad_()
    old = torch.zeros(1, 3, dtype=torch.float64)
    loss, _ = obj.ppo_loss(logp, old, t([[1.0, -1.0, 2.0]]), t([[1, 1, 1]]))
    loss.backward()
    # d/dlogp of -A·r = -A·r ; only token 2 is unclipped: -2·1.1/3
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -2 * 1.1 / 3])


def test_value_loss_hand_computed():
    v = t([[1.5, 0.1, 0.0]])
    old = t([[1.0, 0.0, 0.0]])
    ret = t([[2.0, 1.0, 5.0]])
    mask = t([[1, 1, 0]])
    loss, m = obj.value_loss(v, old, ret, mask, value_clip=0.2)
    # token 0: unclipped (1.5-2)^2 = .25, clipped V=1.2 -> (1.2-2)^2 = .64 -> .64
    # token 1: unclipped (0.1-1)^2 = .81, clipped V=0.1 (inside) -> .81
    assert loss.item() == pytest.approx((0.64 + 0.81) / 2)  # no 1/2 (VIME)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)  # |V - V_old| = .5 > .2 on token 0 only


def test_gae_hand_computed():
    rewards = t([1.0, 2.0])
    values = t([[0.5, 0.6, 0.7, 9.0], [0.0, 1.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [0, 1, 1, 0]])
    adv, ret = obj.gae_advantages(rewards, mask, values=values, gamma=1.0, lam=0.95, whiten=False)
    # row 0: reward on t=2. δ2 = 1 - .7 = .3; δ1 = .7 - .6 = .1; δ0 = .6 - .5 = .1
    #        A2 = .3, A1 = .1 + .95·.3 = .385, A0 = .1 + .95·.385 = .46575
    # row 1: valid t=1,2; reward 2 on t=2. δ2 = 2 - 0 = 2, δ1 = 0 + 0 - 1 = -1; A1 = -1 + .95·2 = .9
    assert adv.flatten().tolist() == pytest.approx([0.46575, 0.385, 0.3, 0.0, 0.0, 0.9, 2.0, 0.0])
    assert ret.flatten().tolist() == pytest.approx([0.96575, 0.985, 1.0, 0.0, 0.0, 1.9, 2.0, 0.0])
    # gamma < 1: row 0 with γ=.5, λ=1: δ2=.3, δ1 = .5·.7-.6 = -.25, δ0 = .5·.6-.5 = -.2
    # A2=.3, A1 = -.25+.5·.3 = -.1, A0 = -.2 + .5·(-.1) = -.25
    adv2, _ = obj.gae_advantages(rewards[:1], mask[:1], values=values[:1], gamma=0.5, lam=1.0, whiten=False)
    assert adv2.tolist()[0] == pytest.approx([-0.25, -0.1, 0.3, 0.0])


def test_whitening_hand_computed():
    x = t([[1.0, 2.0, 7.0], [3.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # valid 1,2,3: mean 2, unbiased var 1
    w = obj.masked_whiten(x, mask)
    s = 1 / math.sqrt(1 + 1e-8)
    assert w.flatten().tolist() == pytest.approx([-s, 0.0, 0.0, s, 0.0, 0.0])
    adv, _ = obj.gae_advantages(t([1.0]), t([[1, 1, 1]]), values=t([[0.5, 0.6, 0.7]]))
    raw = [0.46575, 0.385, 0.3]
    mean = sum(raw) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 2)
    assert adv.tolist()[0] == pytest.approx([(a - mean) / math.sqrt(std**2 + 1e-8) for a in raw])


def test_grpo_advantages_hand_computed():
    rewards = t([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 7, 7])
    mask = t([[1, 1, 0]] * 6)
    adv, ret = obj.grpo_advantages(rewards, mask, group_ids=groups)
    # group 0: mean .5, unbiased std sqrt((4·.25)/3) = sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # group 7: mean 2, std sqrt((1+1)/1) = sqrt 2
    b = 1.0 / (math.sqrt(2) + 1e-6)
    expect = [a, -a, -a, a, b, -b]
    assert adv[:, 0].tolist() == pytest.approx(expect)
    assert adv[:, 1].tolist() == pytest.approx(expect)
    assert adv[:, 2].tolist() == [0.0] * 6
    assert torch.equal(ret, adv)
    with pytest.raises(ValueError, match="at least 2 completions"):
        obj.grpo_advantages(t([1.0, 2.0, 3.0]), t([[1]] * 3), group_ids=torch.tensor([0, 0, 1]))


def test_grpo_equal_rewards_zero_advantages_and_zero_grad():
    # 0.1 three times: the float mean is 0.10000000000000002, not 0.1
    rewards = t([0.1, 0.1, 0.1, 0.7, 0.7])
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = t([[1, 1, 1]] * 5)
    adv, _ = obj.grpo_advantages(rewards, mask, group_ids=groups)
    assert torch.count_nonzero(adv).item() == 0
    logp = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = obj.grpo_loss(logp, logp.detach() + 0.3, adv, mask)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logp.grad).item() == 0


def test_dppo_hand_computed_and_weight_clamping():
    # weights exp(prox - behav): 3 -> 2 (clamped high), 0.25 -> 0.5 (clamped low), 1.5 -> 1.5
    prox = t([[0.0, 0.0, 0.0]])
    behav = t([[-math.log(3.0), math.log(4.0), -math.log(1.5)]])
    logp = t([[math.log(1.5), math.log(1.1), math.log(0.9)]]).requires_grad_()
    adv = t([[1.0, 2.0, -1.0]])
    mask = t([[1, 1, 1]])
    loss, m = obj.dppo_loss(logp, prox, behav, adv, mask, clip_eps=0.2)
    # token 0: r=1.5, A=1: max(-1.5, -1.2) = -1.2, ×2 = -2.4
    # token 1: r=1.1, A=2: -2.2, ×0.5 = -1.1
    # token 2: r=0.9, A=-1: max(0.9, 0.9) = 0.9, ×1.5 = 1.35
    assert loss.item() == pytest.approx((-2.4 - 1.1 + 1.35) / 3)
    assert m["weight_mean"].item() == pytest.approx((3 + 0.25 + 1.5) / 3)  # the raw weight (VIME's tis)
    assert m["weight_clampfrac"].item() == pytest.approx(2 / 3)
    assert m["clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp of -A·r·w = -A·r·w (unclipped tokens only)
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -2 * 1.1 * 0.5 / 3, 1 * 0.9 * 1.5 / 3])


def _probs_to_logp(rows):
    return torch.log(t(rows))


def test_flow_dppo_gate_fires_and_does_not_fire():
    old = _probs_to_logp([[[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]])
    new_p = [[[0.6, 0.4], [0.52, 0.48], [0.6, 0.4], [0.6, 0.4]]]
    # D for [.6,.4]: .5 ln(.5/.6) + .5 ln(.5/.4) = 0.0204... > 0.01; for [.52,.48]: 0.0008 < 0.01
    d_big = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    d_small = 0.5 * math.log(0.5 / 0.52) + 0.5 * math.log(0.5 / 0.48)
    assert d_big > 0.01 > d_small
    logits = torch.log(t(new_p)).requires_grad_()
    new = torch.log_softmax(logits, dim=-1)
    actions = torch.tensor([[0, 0, 1, 1]])
    adv = t([[1.0, 1.0, 1.0, -1.0]])
    mask = t([[1, 1, 1, 1]])
    loss, m = obj.flow_dppo_loss(new, old, actions, adv, mask, kl_budget=0.01)
    # token 0: ρ = 1.2, A>0, outward, D big   -> BLOCKED (value -1.2, no grad)
    # token 1: ρ = 1.04, A>0, outward, D small -> not blocked
    # token 2: ρ = 0.8, A>0, inward, D big     -> not blocked
    # token 3: ρ = 0.8, A<0, outward, D big    -> BLOCKED (value +0.8, no grad)
    rho = [1.2, 1.04, 0.8, 0.8]
    a = [1.0, 1.0, 1.0, -1.0]
    assert loss.item() == pytest.approx(sum(-r * x for r, x in zip(rho, a, strict=True)) / 4)
    assert m["gate_frac"].item() == pytest.approx(0.5)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    assert m["kl_mean"].item() == pytest.approx((3 * d_big + d_small) / 4)
    loss.backward()
    g = logits.grad[0]
    # blocked tokens: no gradient; open tokens: d(-ρA)/dlogit_v = -A·ρ·(1[v=a] - p(v)) / N
    assert g[0].tolist() == [0.0, 0.0]
    assert g[3].tolist() == [0.0, 0.0]
    p1, p2 = new_p[0][1], new_p[0][2]
    assert g[1].tolist() == pytest.approx([-1.04 * (1 - p1[0]) / 4, -1.04 * (0 - p1[1]) / 4])
    assert g[2].tolist() == pytest.approx([-0.8 * (0 - p2[0]) / 4, -0.8 * (1 - p2[1]) / 4])


def test_flow_dppo_no_gate_when_budget_large():
    old = _probs_to_logp([[[0.5, 0.5]]])
    logits = torch.log(t([[[0.6, 0.4]]])).requires_grad_()
    new = torch.log_softmax(logits, -1)
    loss, m = obj.flow_dppo_loss(new, old, torch.tensor([[0]]), t([[1.0]]), t([[1]]), kl_budget=1.0)
    loss.backward()
    assert m["gate_frac"].item() == 0.0
    assert torch.count_nonzero(logits.grad).item() == 2


def test_tempered_logprobs():
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])
    lp = obj.tempered_logprobs(logits, 0.5)
    z = [2.0, 4.0, 6.0]
    lse = math.log(sum(math.exp(v) for v in z))
    assert lp[0, 0].tolist() == pytest.approx([v - lse for v in z])


# ------------------------------------------------------------------------------- loop references


def _rand(seed, shape):
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    mask = (torch.rand(B, T, generator=g) > 0.25).double()
    mask[:, 0] = 1.0
    return g, mask


def _loop_mean(values, mask, mode="token-mean", row=None):
    """``values``, ``mask``: flat lists of a (B, T) batch with rows of ``row`` tokens."""
    if mode == "token-mean":
        num = sum(v * m for v, m in zip(values, mask, strict=True))
        return num / max(sum(mask), 1.0)
    rows = [(values[i : i + row], mask[i : i + row]) for i in range(0, len(values), row)]
    return sum(_loop_mean(v, m) for v, m in rows) / len(rows)


@pytest.mark.parametrize("mode", ["sample-mean", "token-mean"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_ppo_and_dppo_loop_vs_vectorized(seed, shape, mode):
    g, mask = _rand(seed, shape)
    logp = torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3
    old = torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3
    behav = torch.randn(*shape, generator=g, dtype=torch.float64)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    eps = 0.2
    ppo_tok, dppo_tok, clip = [], [], []
    for b in range(shape[0]):
        for i in range(shape[1]):
            r = math.exp(logp[b, i].item() - old[b, i].item())
            a = adv[b, i].item()
            rc = min(max(r, 1 - eps), 1 + eps)
            ppo_tok.append(max(-r * a, -rc * a))
            clip.append(1.0 if -rc * a > -r * a else 0.0)
            w = min(max(math.exp(old[b, i].item() - behav[b, i].item()), 0.5), 2.0)
            dppo_tok.append(max(-r * a, -rc * a) * w)
    m = mask.flatten().tolist()
    loss, met = obj.ppo_loss(logp, old, adv, mask, clip_eps=eps, aggregation=mode)
    assert loss.item() == pytest.approx(_loop_mean(ppo_tok, m, mode, shape[1]), rel=1e-12)
    assert met["clipfrac"].item() == pytest.approx(_loop_mean(clip, m, mode, shape[1]), rel=1e-12)
    loss_d, _ = obj.dppo_loss(logp, old, behav, adv, mask, clip_eps=eps, aggregation=mode)
    assert loss_d.item() == pytest.approx(_loop_mean(dppo_tok, m, mode, shape[1]), rel=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_flow_dppo_loop_vs_vectorized(seed, shape):
    g, mask = _rand(seed, shape)
    V = 5
    old = torch.log_softmax(torch.randn(*shape, V, generator=g, dtype=torch.float64), -1)
    new = torch.log_softmax(old + 0.3 * torch.randn(*shape, V, generator=g, dtype=torch.float64), -1)
    actions = torch.randint(0, V, shape, generator=g)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    budget = 0.02
    tok, gate, blocked_any, open_any = [], [], False, False
    for b in range(shape[0]):
        for i in range(shape[1]):
            po = [math.exp(x) for x in old[b, i].tolist()]
            lo_row, ln_row = old[b, i].tolist(), new[b, i].tolist()
            d = max(0.0, sum(p * (lo - ln) for p, lo, ln in zip(po, lo_row, ln_row, strict=True)))
            a_t = actions[b, i].item()
            log_ratio = new[b, i, a_t].item() - old[b, i, a_t].item()
            rho = math.exp(log_ratio)
            a = adv[b, i].item()
            blocked = ((a > 0 and log_ratio > 0) or (a < 0 and log_ratio < 0)) and d > budget
            tok.append(-rho * a)
            gate.append(1.0 if blocked else 0.0)
            if mask[b, i]:
                blocked_any |= blocked
                open_any |= not blocked
    m = mask.flatten().tolist()
    loss, met = obj.flow_dppo_loss(new, old, actions, adv, mask, kl_budget=budget)
    assert loss.item() == pytest.approx(_loop_mean(tok, m, "sample-mean", shape[1]), rel=1e-12)
    assert met["gate_frac"].item() == pytest.approx(_loop_mean(gate, m, "sample-mean", shape[1]), rel=1e-12)
    assert open_any  # the random cases include open tokens


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gae_skip_loop_vs_vectorized(seed, shape):
    """``gae_masked: skip`` (hobson's rule before conventions v2): the recursion carries over holes."""
    g, mask = _rand(seed, shape)
    values = torch.randn(*shape, generator=g, dtype=torch.float64)
    rewards = torch.randn(shape[0], generator=g, dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    expect_adv, expect_ret = [], []
    for b in range(shape[0]):
        valid = [i for i in range(shape[1]) if mask[b, i] > 0]
        row_adv = [0.0] * shape[1]
        row_ret = [0.0] * shape[1]
        nxt_v, nxt_a = 0.0, 0.0
        for k in reversed(range(len(valid))):
            i = valid[k]
            r = rewards[b].item() if k == len(valid) - 1 else 0.0
            delta = r + gamma * nxt_v - values[b, i].item()
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = values[b, i].item()
            row_adv[i] = nxt_a
            row_ret[i] = nxt_a + nxt_v
        expect_adv.append(row_adv)
        expect_ret.append(row_ret)
    adv, ret = obj.gae_advantages(rewards, mask, values=values, gamma=gamma, lam=lam, whiten=False, masked="skip")
    assert torch.allclose(adv, t(expect_adv), atol=1e-12)
    assert torch.allclose(ret, t(expect_ret), atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_grpo_loop_vs_vectorized(seed, shape):
    g, mask = _rand(seed, shape)
    B = shape[0]
    groups = torch.arange(B) // 2
    rewards = torch.randint(0, 3, (B,), generator=g).double()
    adv, _ = obj.grpo_advantages(rewards, mask, group_ids=groups)
    for grp in groups.unique().tolist():
        members = [i for i in range(B) if groups[i] == grp]
        rs = [rewards[i].item() for i in members]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        for i, r in zip(members, rs, strict=True):
            a = 0.0 if max(rs) == min(rs) else (r - mean) / (std + 1e-6)
            assert adv[i].tolist() == pytest.approx([a * mk for mk in mask[i].tolist()], abs=1e-12)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    lp = obj.token_logprobs(logits, torch.tensor([[2, 1]]), temperature=0.5)
    lse = math.log(math.exp(2.0) + math.exp(4.0) + math.exp(6.0))
    assert lp.tolist()[0] == pytest.approx([6.0 - lse, -math.log(3.0)])
    ent = obj.entropy(obj.tempered_logprobs(logits, 1.0))
    assert ent[0, 1].item() == pytest.approx(math.log(3.0))
    p = [math.exp(v - math.log(math.exp(1) + math.exp(2) + math.exp(3))) for v in (1.0, 2.0, 3.0)]
    assert ent[0, 0].item() == pytest.approx(-sum(q * math.log(q) for q in p))
