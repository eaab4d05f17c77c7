"""Nanbeige looped model: loops, per-loop KV slots, KV-cache decoding, equivalence with HF Llama (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from hobson.errors import ConfigError
from hobson.models import get_provider, tiny_config
from hobson.models.nanbeige import NanbeigeConfig, NanbeigeLooped


def _ids(B, T, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _build(**overrides):
    cfg = tiny_config("nanbeige", **overrides)
    return get_provider(cfg).build_actor(cfg, seed=11)


def test_head_dim_read_from_config():
    m = _build()
    assert m.config.head_dim == 32 != m.config.hidden_size // m.config.num_attention_heads
    assert m.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    assert m.model.layers[0].self_attn.k_proj.weight.shape == (64, 64)
    assert m.model.layers[0].self_attn.o_proj.weight.shape == (64, 128)
    assert NanbeigeConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4}).head_dim == 16


def test_unsupported_config_refused():
    with pytest.raises(ConfigError, match=r"tie_word_embeddings=True is not supported.*rope_scaling="):
        tiny_config("nanbeige", tie_word_embeddings=True, rope_scaling={"type": "linear", "factor": 2.0})


def test_loop_count_changes_output():
    two = _build()
    one_cfg = tiny_config("nanbeige", num_loops=1)
    one = NanbeigeLooped(one_cfg)
    one.load_state_dict(two.state_dict())
    ids = _ids(2, 7)
    with torch.no_grad():
        assert not torch.allclose(two(ids), one(ids), atol=1e-3)


def test_incremental_decode_matches_full_forward_and_loops_have_own_slots():
    m = _build()
    ids = _ids(3, 10, seed=1)
    with torch.no_grad():
        full = m(ids)
        cache = m.new_cache()
        steps = [m.prefill(ids[:, :4], cache)]
        for t in range(4, 10):
            steps.append(m.decode_step(ids[:, t], cache)[:, None])
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    L = m.config.num_hidden_layers
    assert sorted(cache.streams) == list(range(L * m.config.num_loops))
    for i in range(L):
        k0, _ = cache.streams[i]
        k1, _ = cache.streams[i + L]
        assert k0.shape == (3, 2, 10, 32)
        assert not torch.allclose(k0, k1)  # loop 1 attends to its own history, not loop 0's


def test_left_padded_rows_match_unpadded():
    m = _build()
    ids = _ids(1, 6, seed=2)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = m(ids)
        out = m(padded, attention_mask=mask, position_ids=pos)
        # and decoding on after the padded prefill
        cache = m.new_cache()
        m.prefill(padded[:, :-1], cache, attention_mask=mask[:, :-1], position_ids=pos[:, :-1])
        last = m.decode_step(padded[:, -1], cache, position_ids=pos[:, -1:])
    assert torch.allclose(out[:, 2:], ref, atol=1e-5)
    assert torch.allclose(last, ref[:, -1], atol=1e-5)


def _llama(m, layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = m.config
    cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=len(layers),
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    ref = LlamaForCausalLM(cfg).eval()
    state = {k: v for k, v in m.state_dict().items() if not k.startswith("model.layers.")}
    for j, i in enumerate(layers):
        for k, v in m.model.layers[i].state_dict().items():
            state[f"model.layers.{j}.{k}"] = v
    ref.load_state_dict(state, strict=True)
    return ref


def test_matches_hf_llama():
    # one loop is a Llama with the same names; two loops without the loop-final norm are a
    # Llama whose layers repeat (same positions, each repetition its own attention)
    ids = _ids(2, 9, seed=3)
    one = _build(num_loops=1)
    two = _build(skip_loop_final_norm=True)
    with torch.no_grad():
        ref1 = _llama(one, [0, 1])(ids).logits
        ref2 = _llama(two, [0, 1, 0, 1])(ids).logits
        assert torch.allclose(one(ids), ref1, atol=1e-5)
        assert torch.allclose(two(ids), ref2, atol=1e-5)
        # the loop-final norm (the default) changes the result
        normed = NanbeigeLooped(tiny_config("nanbeige"))
        normed.load_state_dict(two.state_dict())
        assert not torch.allclose(normed(ids), ref2, atol=1e-3)


def test_gradient_checkpointing_gives_the_same_gradients():
    m = _build()
    ids = _ids(2, 6)

    def grads():
        m.zero_grad(set_to_none=True)
        m(ids).logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    plain = grads()
    m.gradient_checkpointing = True
    ckpt = grads()
    for name, g in plain.items():
        assert torch.allclose(g, ckpt[name], atol=1e-6), name


def test_fused_projections_keep_the_weights_and_the_outputs():
    """The engine's q/k/v and gate/up fusion: same parameters (as views of one matrix), same logits."""
    from hobson.rollout import publication

    m = _build()
    provider = get_provider(m.config)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    digest = publication.tensors_digest(provider._export_tensors(m))
    ids = _ids(3, 9, seed=2)
    with torch.no_grad():
        want = m(ids)
        m.fuse_projections()
        got = m(ids)
    after = m.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert publication.tensors_digest(provider._export_tensors(m)) == digest
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("skip_norm", [False, True])
def test_deferred_residual_adds_give_the_same_bits(skip_norm):
    """The forward moves each layer's last residual add into the next norm (one kernel when
    fused); eager it must be the layer-by-layer forward bit for bit, loop-final norms or not."""
    from hobson.models.common import prepare_attention
    from hobson.models.nanbeige import rope_cos_sin

    m = _build(skip_loop_final_norm=skip_norm)
    cfg = m.config
    ids = _ids(2, 7, seed=5)
    with torch.no_grad():
        positions, mask, _ = prepare_attention(None, None, 2, 7, ids.device, None)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        x = m.model.embed_tokens(ids)
        for loop in range(cfg.num_loops):
            for i, layer in enumerate(m.model.layers):
                x = layer(x, cos, sin, mask, None, i + loop * cfg.num_hidden_layers)
            if loop == cfg.num_loops - 1 or not skip_norm:
                x = m.model.norm(x)
        assert torch.equal(m(ids), m.lm_head(x).float())
