"""Huginn (raven) model: latent state, RoPE dtype, truncated backprop, KV-cache decoding (CPU, fp32)."""

from __future__ import annotations

import hashlib
import math
import warnings

import pytest
import torch

from hobson.errors import ConfigError
from hobson.models import get_provider, tiny_config
from hobson.models.huginn import (
    LATENT_PROFILE,
    check_latent_profile,
    initial_state,
    latent_profile,
    latent_seed,
    latent_vector,
    rope_table,
)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("huginn_raven")
    return get_provider(cfg).build_actor(cfg, seed=7)


def _ids(B, T, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def test_latent_seed_is_vllm_rlts_blake2b():
    digest = hashlib.blake2b((42).to_bytes(8, "little") + (17).to_bytes(8, "little"), digest_size=8).digest()
    assert LATENT_PROFILE == "like-init-cpu-f32-v1"
    assert latent_seed(42, 17) == int.from_bytes(digest, "little") % 2**63
    assert latent_seed(42, 17) != latent_seed(17, 42)


def test_latent_vector_reproducible_and_truncated():
    E = 64
    a, b = latent_vector(3, 5, E), latent_vector(3, 5, E)
    assert a.dtype == torch.float32 and a.shape == (E,)
    assert torch.equal(a, b)
    assert not torch.equal(a, latent_vector(3, 6, E))
    assert not torch.equal(a, latent_vector(4, 5, E))
    many = torch.stack([latent_vector(0, p, E) for p in range(64)])
    sigma = math.sqrt(2 / (5 * E))
    assert many.abs().max().item() <= 3 * sigma * math.sqrt(E) + 1e-6
    # a normal truncated at ±3σ keeps ~98.7% of its std
    assert abs(many.std().item() / (sigma * math.sqrt(E)) - 0.987) < 0.05


def test_initial_state_independent_of_batch_composition():
    pos = torch.arange(6).expand(2, 6)
    s1 = initial_state([11, 22], pos, 64)
    s2 = initial_state([33, 11], pos, 64)
    assert torch.equal(s1[0], s2[1])
    assert not torch.equal(s1[0], s1[1])
    shifted = initial_state([11], torch.arange(3, 9)[None], 64)
    assert torch.equal(shifted[0, :3], s1[0, 3:])  # a position's state does not depend on where it sits


def test_model_output_independent_of_batch_composition(model):
    ids = _ids(3, 8)
    with torch.no_grad():
        batch = model(ids, seed=[5, 6, 7])
        alone = model(ids[1:2], seed=[6])
        other_seed = model(ids[1:2], seed=[8])
    assert torch.allclose(batch[1:2], alone, atol=1e-5)
    assert not torch.allclose(alone, other_seed, atol=1e-3)


def test_fp16_keeps_rope_fp32():
    cfg = tiny_config("huginn_raven")
    m = get_provider(cfg).build_actor(cfg, seed=1)
    want = rope_table(16, 64, 50000.0)
    assert torch.equal(m.freqs_cis, want)
    m.half()
    assert m.transformer.wte.weight.dtype == torch.float16
    assert m.freqs_cis.dtype == torch.float32 and torch.equal(m.freqs_cis, want)
    assert m.lm_head.weight is m.transformer.wte.weight
    m.to(torch.bfloat16)
    assert m.freqs_cis.dtype == torch.float32 and torch.equal(m.freqs_cis, want)
    assert m.state_dict()["freqs_cis"].dtype == torch.float32
    with torch.no_grad():
        out = m(_ids(1, 4), seed=0)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def _grads(model, no_grad, with_grad):
    model.zero_grad(set_to_none=True)
    out = model(_ids(2, 6), num_steps_no_grad=no_grad, num_steps_with_grad=with_grad, seed=[1, 2])
    out.logsumexp(-1).sum().backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def test_truncated_backprop(model):
    g0 = _grads(model, 3, 0)
    for name, g in g0.items():
        if name.startswith(("transformer.prelude", "transformer.adapter", "transformer.core_block")):
            assert g is None, f"{name} got a gradient through no-grad recurrence steps"
    assert g0["transformer.coda.0.mlp.fc.weight"] is not None
    assert g0["transformer.wte.weight"] is not None  # through the tied lm_head
    g1 = _grads(model, 2, 1)
    for name in (
        "transformer.prelude.0.attn.Wqkv.weight",
        "transformer.adapter.weight",
        "transformer.core_block.1.mlp.proj.weight",
    ):
        assert g1[name] is not None and g1[name].abs().sum() > 0, name
    # the with-grad steps see the no-grad steps' state, not their graph: same total depth,
    # different split -> same forward value, different gradients
    with torch.no_grad():
        a = model(_ids(2, 6), num_steps_no_grad=2, num_steps_with_grad=2, seed=[1, 2])
        b = model(_ids(2, 6), num_steps_no_grad=4, num_steps_with_grad=0, seed=[1, 2])
    assert torch.equal(a, b)
    g2 = _grads(model, 1, 3)
    assert not torch.allclose(g1["transformer.adapter.weight"], g2["transformer.adapter.weight"])
    model.zero_grad(set_to_none=True)


def test_default_depth_is_mean_recurrence(model):
    with torch.no_grad():
        a = model(_ids(1, 5), seed=3)
        b = model(_ids(1, 5), num_steps_no_grad=4, seed=3)
        c = model(_ids(1, 5), num_steps_no_grad=3, seed=3)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_incremental_decode_matches_full_forward(model):
    ids = _ids(3, 12, seed=1)
    seeds = [10, 20, 30]
    with torch.no_grad():
        full = model(ids, seed=seeds)
        cache = model.new_cache()
        steps = [model.prefill(ids[:, :5], cache, seed=seeds)]
        for t in range(5, 12):
            steps.append(model.decode_step(ids[:, t], cache, seed=seeds)[:, None])
    inc = torch.cat(steps, dim=1)
    assert torch.allclose(inc, full, atol=1e-5, rtol=1e-5)
    # one KV stream per prelude layer, per (recurrence step x core layer), per coda layer
    assert len(cache.streams) == 1 + 4 * 2 + 1 and cache.length == 12
    with pytest.raises(ValueError, match="num_steps=4, this call uses 3"):
        model.decode_step(ids[:, 0], cache, seed=seeds, num_steps_no_grad=3)


def test_left_padded_rows_match_unpadded(model):
    ids = _ids(1, 6, seed=2)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(ids, seed=4)
        out = model(padded, seed=4, attention_mask=mask, position_ids=pos)
    assert torch.allclose(out[:, 3:], ref, atol=1e-5)


def test_right_padding_leaves_real_tokens_unchanged(model):
    ids = _ids(1, 6, seed=3)
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert torch.allclose(model(padded, seed=9)[:, :6], model(ids, seed=9), atol=1e-5)


def test_latent_profile_check():
    rec = latent_profile(torch.float16)
    assert rec["profile"] == "like-init-cpu-f32-v1" and rec["dtype"] == "float16"
    check_latent_profile(rec, torch.float16)
    with pytest.raises(ConfigError, match=r"dtype: recorded 'float16', now 'float32'"):
        check_latent_profile(rec, torch.float32)
    with pytest.raises(ConfigError, match=r"torch: recorded '1.0', now"):
        check_latent_profile({**rec, "torch": "1.0"}, torch.float16)


def test_gradient_checkpointing_gives_the_same_gradients(model):
    g_plain = _grads(model, 1, 2)
    model.gradient_checkpointing = True
    try:
        g_ckpt = _grads(model, 1, 2)
    finally:
        model.gradient_checkpointing = False
    for name, g in g_plain.items():
        assert (g is None) == (g_ckpt[name] is None), name
        if g is not None:
            assert torch.allclose(g, g_ckpt[name], atol=1e-6), name


def test_config_checks():
    with pytest.raises(ConfigError, match=r"head_dim 32 != n_embd // n_heads = 16"):
        tiny_config("huginn_raven", head_dim=32)
    with pytest.raises(ConfigError, match=r"n_embd 64 is not a multiple of n_heads 5"):
        tiny_config("huginn_raven", n_heads=5)
    with pytest.raises(ConfigError, match=r"state_init 'zero' is not supported"):
        tiny_config("huginn_raven", state_init="zero")
    with pytest.raises(ValueError, match="position 64 is beyond block_size 64"):
        m = get_provider(tiny_config("huginn_raven")).build_actor(tiny_config("huginn_raven"))
        m(_ids(1, 65), num_steps_no_grad=1)


def test_fp16_forward_backward_on_cpu():
    cfg = tiny_config("huginn_raven")
    m = get_provider(cfg).build_actor(cfg, seed=1, dtype=torch.float16)
    assert m.freqs_cis.dtype == torch.float32 and m.transformer.adapter.weight.dtype == torch.float16
    out = m(_ids(2, 5), num_steps_no_grad=2, num_steps_with_grad=2, seed=[0, 1])
    (out.logsumexp(-1).sum() * 128.0).backward()  # a static loss scale, as the fp16 trainer uses
    assert m.transformer.adapter.weight.grad.dtype == torch.float16
    assert torch.isfinite(m.transformer.adapter.weight.grad).all()
    with torch.no_grad():
        ref = get_provider(cfg).build_actor(cfg, seed=1)(_ids(2, 5), seed=[0, 1])
        assert (m(_ids(2, 5), seed=[0, 1]) - ref).abs().max() < 0.1


def test_initial_state_is_the_vectors_one_by_one():
    """Each distinct (seed, position) is drawn once and gathered; the state is bit for bit the
    vectors drawn one after another, repeated positions (left padding at 0) included."""
    pos = torch.arange(40).repeat(3, 1)
    pos[1, :7] = 0
    seeds = [7, 8, 7]
    state = initial_state(seeds, pos, 24)
    want = torch.stack([torch.stack([latent_vector(s, int(p), 24) for p in row])
                        for s, row in zip(seeds, pos, strict=True)])
    assert torch.equal(state, want)
    assert torch.equal(initial_state([7], pos[:1, :2], 24), want[:1, :2])
    assert initial_state([1, 2], torch.zeros(2, 0, dtype=torch.long), 24).shape == (2, 0, 24)


def test_training_forward_with_length_free_fused_chains_matches_eager():
    """Training forwards inside ``fused_kernels(dynamic=True)``: the compiled norm, RoPE and MLP
    chains serve every length without a recompile per length, checkpointed blocks recompute with
    the same kernels, and the gradients agree with the eager model's (compiled code may round
    differently, never by much)."""
    import torch._dynamo

    from hobson.models.common import fused_kernels

    cfg = tiny_config("huginn_raven")
    m = get_provider(cfg).build_actor(cfg, seed=0)
    m.train()
    # as the RL trainer runs it: the backward recomputes each block, which must run the same
    # (compiled) kernels as its forward did, or torch refuses the recomputed tensors
    m.gradient_checkpointing = True
    torch._dynamo.reset()
    # a recompile per length would pass this limit, and then fail instead of running eagerly unseen
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True), warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch.compile of")
        for T in (5, 9, 13, 7):
            ids = _ids(2, T, seed=T)
            grads = []
            for on in (False, True):
                m.zero_grad(set_to_none=True)
                with fused_kernels(on=on, dynamic=True):
                    out = m(ids, num_steps_no_grad=2, num_steps_with_grad=2, seed=[0, 1])
                out.logsumexp(-1).mean().backward()
                grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
            torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


def test_latent_cache_gives_the_drawn_bits_and_stays_within_its_bound():
    """What the cache returns equals a fresh draw bit for bit; a second initial_state of the same
    rows draws nothing; the oldest vectors go first once the bound is reached."""
    from hobson.models.huginn import LatentCache

    cache = LatentCache(max_bytes=10 * 24 * 4)  # ten vectors of width 24
    for p in range(12):
        assert torch.equal(cache.vector(3, p, 24), latent_vector(3, p, 24))
    assert (cache.misses, cache.hits, cache.bytes) == (12, 0, 10 * 24 * 4)
    assert torch.equal(cache.vector(3, 11, 24), latent_vector(3, 11, 24)) and cache.hits == 1
    cache.vector(3, 0, 24)  # evicted (the oldest two went): drawn again
    assert cache.misses == 13

    import hobson.models.huginn as h

    h.latent_cache().clear()
    pos = torch.arange(9).repeat(2, 1)
    first = initial_state([5, 6], pos, 24)
    drawn = h.latent_cache().misses
    assert drawn == 18 and torch.equal(initial_state([5, 6], pos, 24), first)
    assert h.latent_cache().misses == drawn and h.latent_cache().hits == 18
    assert LatentCache(max_bytes=0).vector(1, 2, 24).shape == (24,)  # off: draws, keeps nothing


@pytest.mark.parametrize("raw", ["lots", "-1", "nan"])
def test_a_bad_latent_cache_size_is_one_clear_error(monkeypatch, raw):
    import hobson.models.huginn as h

    monkeypatch.setattr(h, "_LATENT_CACHE", [])
    monkeypatch.setenv("HOBSON_LATENT_CACHE_MB", raw)
    with pytest.raises(ConfigError, match=f"HOBSON_LATENT_CACHE_MB='{raw}' is not a size in MiB >= 0"):
        h.latent_cache()
    monkeypatch.setenv("HOBSON_LATENT_CACHE_MB", "0")
    assert h.latent_cache().max_bytes == 0


def test_latents_drawn_once_per_update_are_the_forwards_own():
    """The RL update draws the initial states once (loop._latents) and gives them to its forwards:
    the logits equal, bit for bit, those of a forward that draws them itself."""
    from types import SimpleNamespace

    from hobson.rl.loop import _latents

    cfg = tiny_config("huginn_raven")
    m = get_provider(cfg).build_actor(cfg, seed=2)
    ids, seeds = _ids(3, 11, seed=4), [9, 10, 9]
    given = _latents(m, SimpleNamespace(ids=ids, seeds=seeds), torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(m(ids, seed=seeds, latent_state=given), m(ids, seed=seeds))


def test_each_blocks_last_norm_computing_the_next_first_gives_the_same_bits(monkeypatch):
    """The chains of blocks hand each block's first norm to the block before (one kernel fewer per
    block when fused); eager, prefill, decode steps and a training forward with gradients are the
    block-by-block model's bits."""
    from hobson.models.huginn import HuginnRaven

    cfg = tiny_config("huginn_raven", n_layers_in_prelude=2, n_layers_in_recurrent_block=3, n_layers_in_coda=2)
    m = get_provider(cfg).build_actor(cfg, seed=3)
    ids = _ids(2, 6, seed=4)

    def run() -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        out = m(ids, 2, 1)
        out.float().square().mean().backward()
        outs = [out.detach(), m.transformer.core_block[1].norm_1.weight.grad.clone(),
                m.transformer.coda[1].norm_1.weight.grad.clone()]
        with torch.no_grad():
            cache = m.new_cache()
            outs.append(m.prefill(ids[:, :4], cache, num_steps_no_grad=3))
            for t in (4, 5):
                outs.append(m(ids[:, t:t + 1], 3, cache=cache))
        return outs

    from hobson.models.huginn import SandwichBlock

    folds = []
    chained_fn = SandwichBlock.chained

    def counting(self, x, h, next_norm, *a):  # noqa: ANN001, ANN202
        folds.append(next_norm is not None)
        return chained_fn(self, x, h, next_norm, *a)

    monkeypatch.setattr(SandwichBlock, "chained", counting)
    chained = run()
    # per forward: prelude 1, 2 per recurrence step, coda 1 (the last block of each chain has no next)
    assert sum(folds) == 4 * (1 + 2 * 3 + 1)
    calls = []

    def one_by_one(self, blocks, x, freqs, mask, cache, slots):  # noqa: ANN001, ANN202
        calls.append(len(blocks))
        for block, slot in zip(blocks, slots, strict=True):
            x = self._block(block, x, freqs, mask, cache, slot)
        return x

    monkeypatch.setattr(HuginnRaven, "_chain", one_by_one)
    separate = run()
    assert calls and max(calls) == 3
    assert len(chained) == len(separate) == 6
    for a, b in zip(chained, separate, strict=True):
        assert torch.equal(a, b)


def _concatenated_adapter(monkeypatch):
    """The model as the reference writes it: ``adapter(cat([s, e]))`` in every recurrence step."""
    from hobson.models.huginn import HuginnRaven

    monkeypatch.setattr(HuginnRaven, "injected", lambda self, e: e)

    def core_step(self, state, e, freqs, mask, cache, step):
        x = self.transformer.adapter(torch.cat([state, e], dim=-1))
        blocks = self.transformer.core_block
        return self._chain(blocks, x, freqs, mask, cache, [("core", step, j) for j in range(len(blocks))])

    monkeypatch.setattr(HuginnRaven, "_core_step", core_step)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adapter_split_across_the_recurrence_is_the_concatenated_adapter(monkeypatch, dtype):
    """``W_s·s + (W_e·e + b)``, with ``W_e·e + b`` once per forward, is ``adapter(cat([s, e]))``:
    the same logits, gradients (prelude, adapter halves, core) and cached decode steps, to float64's
    rounding in float64 and float32's in float32. With a bias, too (the official config has none)."""
    cfg = tiny_config("huginn_raven", bias=True)
    m = get_provider(cfg).build_actor(cfg, seed=3).to(dtype)
    with torch.no_grad():
        m.transformer.adapter.bias.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    ids = _ids(2, 7, seed=5)

    def run():
        m.zero_grad(set_to_none=True)
        out = m(ids, num_steps_no_grad=2, num_steps_with_grad=2, seed=[3, 4])
        out.logsumexp(-1).mean().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        cache = m.new_cache()
        with torch.no_grad():
            m.prefill(ids[:, :5], cache, num_steps_no_grad=3, seed=[3, 4])
            steps = [m.decode_step(ids[:, t], cache, num_steps_no_grad=3, seed=[3, 4]) for t in (5, 6)]
        return out.detach(), grads, torch.stack(steps)

    split = run()
    with monkeypatch.context() as mp:
        _concatenated_adapter(mp)
        ref = run()
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(split[0], ref[0], **tol)
    torch.testing.assert_close(split[2], ref[2], **tol)
    assert split[1].keys() == ref[1].keys() and "transformer.adapter.weight" in split[1]
    assert "transformer.adapter.bias" in split[1] and "transformer.prelude.0.attn.Wqkv.weight" in split[1]
    for name in ref[1]:
        torch.testing.assert_close(split[1][name], ref[1][name], **tol, msg=name)
