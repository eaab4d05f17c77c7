"""hobson's RL conventions against the reference that defines them: VIME (vllm-project/vime) and its
engine vllm-rlt (0z5a/vllm-rlt). Each number here is the reference's: an example of the RL
fidelity issue computed with VIME's definition, or the inputs and expected values of VIME's own
tests (file named in each test). docs/RL.md maps every convention to the function it matches.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from hobson.errors import ConfigError
from hobson.models import huginn
from hobson.models.nanbeige import NanbeigeLooped
from hobson.models.nanbeige import tiny_config as nanbeige_tiny
from hobson.rl import objectives as obj
from hobson.rollout.engine import request_seed


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------------------- aggregation


def test_sample_mean_of_token_means_is_vimes_aggregation():
    # per-token losses [1] and [2, 3, 4]: VIME 2.0 (sequence means 1 and 3), token mean 2.5
    loss = t([[1.0, 0.0, 0.0], [2.0, 3.0, 4.0]])
    mask = t([[1, 0, 0], [1, 1, 1]])
    assert obj.aggregate(loss, mask).item() == pytest.approx(2.0)
    assert obj.aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)


def test_cp_utils_sum_of_sample_mean_case():
    # VIME tests/test_cp_utils.py: lengths [3, 3, 3], x = 1..9 -> sum of sample means 15.0; the
    # step's loss divides it by the step's rollout count (loss_function), hobson's mean is 5.0
    x = torch.arange(1.0, 10.0, dtype=torch.float64).reshape(3, 3)
    assert (obj.aggregate(x, torch.ones(3, 3)) * 3).item() == pytest.approx(15.0)


def test_loss_cp_invariance_gradient_case():
    # VIME tests/test_loss_cp_invariance.py: four rollouts, responses x = [1..8]·{1, 10, 100, 1000},
    # a linear weight 1.0, step_global_batch_size 4: the gradient is 1249.875
    w = torch.ones((), dtype=torch.float64, requires_grad=True)
    x = torch.arange(1.0, 9.0, dtype=torch.float64) * t([1.0, 10.0, 100.0, 1000.0])[:, None]
    obj.aggregate(w * x, torch.ones(4, 8)).backward()
    assert w.grad.item() == pytest.approx(1249.875, rel=1e-12)


def test_every_objective_and_metric_uses_the_sample_mean():
    # two sequences of 1 and 3 valid tokens: a token mean would weigh the second 3x
    mask = t([[1, 0, 0], [1, 1, 1]])
    logp = t([[math.log(1.5), 0.0, 0.0], [math.log(0.5), 0.0, math.log(1.1)]])
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = t([[1.0, 0.0, 0.0], [-1.0, 1.0, 2.0]])
    _, m = obj.ppo_loss(logp, old, adv, mask)
    # clipped tokens: seq 0 token 0 (1.5 -> 1.2); seq 1 token 0 (0.5, A<0 -> 0.8)
    assert m["clipfrac"].item() == pytest.approx((1.0 + 1 / 3) / 2)
    assert m["approx_kl"].item() == pytest.approx((-math.log(1.5) + (-math.log(0.5) - math.log(1.1)) / 3) / 2)
    v, vm = obj.value_loss(t([[1.0, 0, 0], [0.0, 0.0, 0.0]]), torch.zeros(2, 3), torch.zeros(2, 3), mask)
    assert v.item() == pytest.approx(0.5) and vm["vf_clipfrac"].item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------- value loss


def test_value_loss_is_vimes():
    # V = 1, V_old = 0.5, R = 0, clip 0.2: VIME loss 1.0, clip fraction 1.0 (hobson before: 0.5, 0.0)
    loss, m = obj.value_loss(t([[1.0]]), t([[0.5]]), t([[0.0]]), t([[1]]), value_clip=0.2)
    assert loss.item() == pytest.approx(1.0)
    assert m["vf_clipfrac"].item() == 1.0


# ------------------------------------------------------------------------------- GAE


def test_gae_runs_over_the_span_holes_included():
    values, mask = t([[0.1, 0.5, 0.3]]), t([[1, 0, 1]])
    adv, ret = obj.gae_advantages(t([1.0]), mask, values=values, gamma=1.0, lam=0.95, whiten=False)
    assert adv.tolist()[0] == pytest.approx([0.84175, 0.465, 0.7], abs=1e-6)  # VIME
    assert ret.tolist()[0] == pytest.approx([0.94175, 0.965, 1.0], abs=1e-6)
    skip, _ = obj.gae_advantages(t([1.0]), mask, values=values, gamma=1.0, lam=0.95, whiten=False, masked="skip")
    assert skip.tolist()[0] == pytest.approx([0.865, 0.0, 0.7], abs=1e-6)  # hobson before, kept as `skip`
    # whitening sees only the mask: the hole's 0.465 is left out of the statistics and zeroed
    white, _ = obj.gae_advantages(t([1.0]), mask, values=values, gamma=1.0, lam=0.95)
    s = math.sqrt((0.84175 - 0.7) ** 2 / 2 + 1e-8)
    assert white.tolist()[0] == pytest.approx([(0.84175 - 0.7) / 2 / s, 0.0, -(0.84175 - 0.7) / 2 / s], abs=1e-6)


def test_gae_reward_on_the_spans_last_position_even_when_masked():
    values, mask, span = t([[0.1, 0.5, 0.3]]), t([[1, 1, 0]]), t([[1, 1, 1]])
    adv, _ = obj.gae_advantages(t([1.0]), mask, values=values, span=span, gamma=1.0, lam=0.95, whiten=False)
    assert adv.tolist()[0] == pytest.approx([0.84175, 0.465, 0.7], abs=1e-6)


def test_gae_right_padded_rows_ignore_prompt_and_padding_values():
    """Rows of different lengths, prompt before and padding after the response: the critic's
    values there are large random numbers and must not matter; on the (contiguous) mask the
    advantages equal hobson's earlier rule and a loop over the response alone."""
    g = torch.Generator().manual_seed(0)
    layout = [(2, 3), (4, 1), (1, 5)]  # (prompt positions, response length) in T = 8
    T = 8
    mask = torch.zeros(3, T, dtype=torch.float64)
    for b, (p, n) in enumerate(layout):
        mask[b, p : p + n] = 1
    values = torch.randn(3, T, generator=g, dtype=torch.float64) * 1e3 * (1 - mask)
    values += torch.randn(3, T, generator=g, dtype=torch.float64) * mask
    rewards = t([1.0, -2.0, 0.5])
    adv, ret = obj.gae_advantages(rewards, mask, values=values, gamma=1.0, lam=0.95, whiten=False)
    old, _ = obj.gae_advantages(rewards, mask, values=values, gamma=1.0, lam=0.95, whiten=False, masked="skip")
    assert torch.equal(adv, old)
    for b, (p, n) in enumerate(layout):
        a_next, v_next = 0.0, 0.0
        for i in reversed(range(p, p + n)):
            r = rewards[b].item() if i == p + n - 1 else 0.0
            a_next = r + v_next - values[b, i].item() + 0.95 * a_next
            v_next = values[b, i].item()
            assert adv[b, i].item() == pytest.approx(a_next, abs=1e-9)
        assert adv[b][mask[b] == 0].abs().max().item() == 0.0 and ret[b][mask[b] == 0].abs().max().item() == 0.0


# ------------------------------------------------------------------------------- GRPO, DPPO, Flow-DPPO


def test_grpo_normalize_rewards_cases():
    # VIME tests/plugins/test_looped_grpo.py: groups of 2, rewards [0, 1, 7, 7]
    mask = torch.ones(4, 1, dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    adv, _ = obj.grpo_advantages(t([0.0, 1.0, 7.0, 7.0]), mask, group_ids=groups)
    assert adv[:, 0].tolist() == pytest.approx([-0.7071058, 0.7071058, 0.0, 0.0], abs=1e-7)
    shifted, _ = obj.grpo_advantages(t([10.0, 11.0, -3.0, -3.0]), mask, group_ids=groups)
    assert torch.equal(shifted, adv)
    equal, _ = obj.grpo_advantages(t([1.0] * 4), mask, group_ids=groups)
    assert equal.abs().sum().item() == 0.0


def _probs(rows):
    return torch.log(t(rows))


def test_looped_dppo_three_policy_case():
    """VIME tests/plugins/test_looped_dppo.py: proximal [.3] / [.8, .2, .8], behaviour [.1] /
    [.9, .9, .1], current π_θ [.32] / [.75, .75, .4], advantages [1] / [-1, 1, -1], loss mask
    [1] / [1, 0, 1]. VIME's policy_loss_function returns the sum of sample means, -0.916667
    (loss_function then divides by the step's 2 rollouts); its tis_clipfrac sum is 1.5."""
    cur = _probs([[0.32, 1.0, 1.0], [0.75, 0.75, 0.4]]).requires_grad_()
    prox = _probs([[0.3, 1.0, 1.0], [0.8, 0.2, 0.8]])
    behav = _probs([[0.1, 1.0, 1.0], [0.9, 0.9, 0.1]])
    adv = t([[1.0, 0.0, 0.0], [-1.0, 1.0, -1.0]])
    mask = t([[1, 0, 0], [1, 0, 1]])
    loss, m = obj.dppo_loss(cur, prox, behav, adv, mask, clip_eps=0.2, weight_min=0.5, weight_max=2.0)
    assert (loss * 2).item() == pytest.approx(-0.916667, abs=1e-6)
    assert (m["weight_clampfrac"] * 2).item() == pytest.approx(1.5)
    # the raw weights 3 | 0.8/0.9, 8 (tis), not the clamped ones
    assert m["weight_mean"].item() == pytest.approx((3.0 + (0.8 / 0.9 + 8.0) / 2) / 2)
    loss.backward()
    assert cur.grad[1, 1].item() == 0.0 and cur.grad[0, 0].item() != 0.0  # the masked token: no gradient
    # the "bypass" loss (ratio against the behaviour policy, no correction) is another number
    bypass, _ = obj.ppo_loss(cur.detach(), behav, adv, mask)
    assert abs(bypass.item() - loss.item()) > 0.1


def test_flow_dppo_full_vocabulary_kl_and_gate():
    # VIME tests/plugins/test_flow_dppo.py::test_full_vocabulary_kl_and_asymmetric_gradient_gate
    logits = torch.log(t([[0.9, 0.1]] * 4))[None].requires_grad_()
    old = torch.full((1, 4, 2), math.log(0.5), dtype=torch.float64)
    loss, m = obj.flow_dppo_loss(torch.log_softmax(logits, -1), old, torch.tensor([[0, 1, 1, 0]]),
                                 t([[1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4), kl_budget=0.05)
    assert m["kl_mean"].item() == pytest.approx(0.5108256, abs=1e-7, rel=1e-6)
    assert m["gate_frac"].item() == pytest.approx(0.5)  # blocked == [1, 1, 0, 0]
    loss.backward()
    assert logits.grad[0, :2].abs().sum().item() == 0.0 and logits.grad[0, 2:].abs().sum().item() > 0


@pytest.mark.parametrize("budget", [0.05, 1.0])
def test_flow_dppo_identical_policy_zero_kl_live_gradient(budget):
    # VIME tests/plugins/test_flow_dppo.py::test_identical_policy_has_zero_kl_and_live_gradient
    old = torch.log(torch.tensor([[[0.25, 0.75]]]))  # float32, as there
    logits = old.clone().requires_grad_()
    loss, m = obj.flow_dppo_loss(torch.log_softmax(logits, -1), old, torch.tensor([[1]]), torch.ones(1, 1),
                                 torch.ones(1, 1), kl_budget=budget)
    assert m["gate_frac"].item() == 0.0 and m["kl_mean"].item() == 0.0
    loss.backward()
    assert logits.grad[0, 0].tolist() == pytest.approx([0.25, -0.25])


def _packed_case():
    """VIME tests/plugins/test_flow_dppo.py::test_packed_frozen_distribution_and_training_loss: two
    responses (1 and 2 tokens), temperature 0.5 over logits log(p)·0.5, actions [0] and [1, 2]."""
    old_p = [[[0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0]], [[0.4, 0.2, 0.1, 0.3], [0.2, 0.1, 0.3, 0.4]]]
    new_p = [[[0.9, 0.05, 0.03, 0.02], [1.0, 1.0, 1.0, 1.0]], [[0.05, 0.1, 0.75, 0.1]] * 2]
    old = obj.tempered_logprobs(torch.log(t(old_p)) * 0.5, 0.5)
    logits = (torch.log(t(new_p)) * 0.5).requires_grad_()
    actions = torch.tensor([[0, 0], [1, 2]])
    adv, mask = t([[1.0, 0.0], [-1.0, -1.0]]), t([[1, 0], [1, 1]])
    return old, logits, actions, adv, mask


def test_flow_dppo_packed_case():
    old, logits, actions, adv, mask = _packed_case()
    loss, m = obj.flow_dppo_loss(obj.tempered_logprobs(logits, 0.5), old, actions, adv, mask, kl_budget=0.05)
    assert loss.item() == pytest.approx(-3.75, abs=1e-6, rel=1e-6)
    assert m["kl_mean"].item() > 0.05
    loss.backward()
    assert logits.grad[0, 0].abs().sum().item() == 0.0 and logits.grad[1, 0].abs().sum().item() == 0.0
    assert logits.grad[1, 1].abs().sum().item() > 0
    # the same batch without the gate (budget None in VIME) is PPO against the old policy: 0.225
    idx = actions.unsqueeze(-1)
    cur = obj.tempered_logprobs(logits.detach(), 0.5).gather(-1, idx).squeeze(-1)
    ppo, _ = obj.ppo_loss(cur, old.gather(-1, idx).squeeze(-1), adv, mask)
    assert ppo.item() == pytest.approx(0.225, abs=1e-6, rel=1e-6)


def test_flow_dppo_outward_by_log_ratio_sign_in_float32():
    # a float32 log-ratio of 2**-24 (5.96e-8) rounds the ratio to exactly 1.0: VIME blocks the token
    old = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    new = old.clone()
    new[0, 0, 0] += 2.0**-24
    new[0, 0, 1:] = torch.log(torch.tensor([0.45, 0.05]))  # the KL budget is spent elsewhere
    new.requires_grad_()
    assert torch.exp(new[0, 0, 0] - old[0, 0, 0]).item() == 1.0
    loss, m = obj.flow_dppo_loss(new, old, torch.tensor([[0]]), torch.ones(1, 1), torch.ones(1, 1), kl_budget=0.01)
    assert m["gate_frac"].item() == 1.0
    loss.backward()
    assert new.grad.abs().sum().item() == 0.0


def test_flow_dppo_kl_is_clamped_and_kl_metric_is_k1():
    # an "old" distribution that is not normalised can give a negative KL sum: clamped at 0
    old = t([[[math.log(0.5), math.log(0.4)]]])
    new = torch.log(t([[[0.5, 0.5]]]))
    _, m = obj.flow_dppo_loss(new, old, torch.tensor([[0]]), t([[1.0]]), t([[1]]), kl_budget=0.01)
    assert m["kl_mean"].item() == 0.0
    new2 = torch.log(t([[[0.6, 0.4]]]))
    _, m2 = obj.flow_dppo_loss(new2, torch.log(t([[[0.5, 0.5]]])), torch.tensor([[0]]), t([[1.0]]), t([[1]]))
    assert m2["approx_kl"].item() == pytest.approx(math.log(0.5) - math.log(0.6))  # k1 = old - new


# ------------------------------------------------------------------------------- seeds and latents


def test_request_seed_is_vimes():
    # vime/backends/vllm_rlt_utils/engine.py: (seed + rollout_id * 1_000_003 + sample.index) % 2**63
    assert request_seed(42, 0, 0) == 42
    assert request_seed(42, 2, 9) == 42 + 2 * 1_000_003 + 9
    assert request_seed(2**63 - 1, 0, 1) == 0


def _reference_latent(seed: int, position: int, width: int) -> torch.Tensor:
    """vllm-rlt huginn_latents.py:replay_huginn_latents, from its definition."""
    ident = seed.to_bytes(8, "little") + position.to_bytes(8, "little")
    noise_seed = int.from_bytes(hashlib.blake2b(ident, digest_size=8).digest(), "little") % 2**63
    std = math.sqrt(2 / (5 * width))
    state = torch.empty(width, dtype=torch.float32)
    torch.nn.init.trunc_normal_(state, std=std, a=-3 * std, b=3 * std,
                                generator=torch.Generator().manual_seed(noise_seed))
    return state * math.sqrt(width)


def test_latent_first_values_for_seed_0_position_0():
    v = huginn.latent_vector(0, 0, 16)
    assert v[:4].tolist() == pytest.approx([-0.743694, -0.572633, 0.006496, -1.557992], abs=1e-6)
    assert huginn.latent_check() == "seed 0, position 0, width 16: -0.743694 -0.572633 0.006496 -1.557992"


@pytest.mark.parametrize(("seed", "position", "width"), [(0, 0, 16), (42, 0, 32), (42, 1, 32), (7, 0, 32),
                                                         (2**63 - 1, 175, 8), (123456789, 3, 64)])
def test_latents_equal_the_reference_definition(seed, position, width):
    assert torch.equal(huginn.latent_vector(seed, position, width), _reference_latent(seed, position, width))


def test_latents_do_not_depend_on_packing_or_global_rng():
    # vllm-rlt tests/test_huginn_latent_replay.py: (42, 0), (7, 0), (42, 1) in any order
    packed = huginn.initial_state([42, 7, 42], torch.tensor([[0], [0], [1]]), 32)
    torch.manual_seed(999)
    reordered = huginn.initial_state([42, 42, 7], torch.tensor([[1], [0], [0]]), 32)
    assert torch.equal(packed, reordered[[1, 2, 0]])
    assert not torch.equal(packed[0], packed[2])


def _vllm_rlt_trace(latent_seed: int) -> dict:
    """A trace in vllm-rlt/VIME's RecurrentTrace field layout (vime/utils/types.py)."""
    return {
        "schema_version": 1, "model_family": "huginn_raven", "model_revision": "r", "engine_revision": "e",
        "runtime_epoch": "0" * 32, "policy_version": 3, "publication_digest": "d" * 64, "request_id": "req-0",
        "seed": latent_seed, "prefill_depth": 32, "decode_depths": [32, 32], "temperature": 0.8,
        "finish_reason": "length", "latent_seed": latent_seed, "latent_profile": "like-init-cpu-f32-v1",
    }


def test_a_vllm_rlt_trace_replays_to_the_latents_training_uses():
    seed = request_seed(42, 1, 5)
    latents = huginn.trace_latents(_vllm_rlt_trace(seed), 6, 32)
    assert torch.equal(latents, torch.stack([_reference_latent(seed, p, 32) for p in range(6)]))
    # what the model replays for that request's seed at positions 0..5 (hobson.models.huginn.initial_state)
    assert torch.equal(latents, huginn.initial_state([seed], torch.arange(6)[None], 32)[0])
    with pytest.raises(ConfigError, match="model_family 'nanbeige'"):
        huginn.trace_latents({**_vllm_rlt_trace(seed), "model_family": "nanbeige"}, 6, 32)
    with pytest.raises(ConfigError, match="latent seed None"):
        huginn.trace_latents({**_vllm_rlt_trace(seed), "latent_seed": None}, 6, 32)
    with pytest.raises(ConfigError, match="latent profile 'legacy'"):
        huginn.trace_latents({**_vllm_rlt_trace(seed), "latent_profile": "legacy"}, 6, 32)


def test_a_trace_or_run_of_the_old_derivation_is_refused():
    old_trace = {"seed": 5, "profile": "like-init-cpu-f32-v1", "depths": [4], "model_revision": "r",
                 "policy_version": 0}  # hobson's layout before the derivation check
    with pytest.raises(ConfigError, match="another seed derivation"):
        huginn.trace_latents(old_trace, 2, 16)
    assert huginn.trace_latents({**old_trace, "check": huginn.latent_check()}, 2, 16).shape == (2, 16)
    recorded = huginn.latent_profile(torch.float32)
    del recorded["check"]
    with pytest.raises(ConfigError, match="check: recorded None.*old SHA-256 seed derivation"):
        huginn.check_latent_profile(recorded, torch.float32)


# ------------------------------------------------------------------------------- Nanbeige


def test_nanbeige_pad_row_of_the_embedding_gets_no_gradient():
    torch.manual_seed(0)
    cfg = nanbeige_tiny()
    model = NanbeigeLooped(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    assert cfg.pad_token_id == 0 and model.model.embed_tokens.padding_idx == 0
    ids = torch.tensor([[5, 0, 7, 0, 9]])
    model(ids).float().sum().backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad[0].abs().sum().item() == 0.0 and grad[5].abs().sum().item() > 0


@pytest.mark.parametrize(("skip", "norms"), [(False, 2), (True, 1)])
def test_nanbeige_skip_loop_final_norm_keeps_the_models_own_readout(skip, norms):
    """The model's own code (and hobson): with skip_loop_final_norm the norm runs once, after the
    last loop; without it after every loop. vllm-rlt's native model applies none with the flag set."""
    model = NanbeigeLooped(nanbeige_tiny(skip_loop_final_norm=skip))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    calls = []
    model.model.norm.register_forward_hook(lambda *a: calls.append(1))
    model(torch.tensor([[1, 2, 3]]))
    assert len(calls) == norms
