"""The fixed-capacity KV cache (device-side indices, what a CUDA graph replays) equals the growing one."""

from __future__ import annotations

import pytest
import torch

from hobson.models import PROVIDERS, tiny_config
from hobson.models.common import KVCache, StaticKVCache


@pytest.mark.parametrize("kind", ["huginn_raven", "nanbeige"])
def test_static_cache_decodes_like_the_growing_cache(kind: str) -> None:
    cfg = tiny_config(kind)
    model = PROVIDERS[kind].build_actor(cfg, seed=3)
    B, P, steps = 3, 6, 4
    lens = torch.tensor([6, 4, 2])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (B, P), generator=g)
    attn = (torch.arange(P)[None, :] >= (P - lens)[:, None]).long()  # left padding
    pos = (torch.arange(P)[None, :] - (P - lens)[:, None]).clamp(min=0)
    kw = {"seed": [5, 6, 7]} if kind == "huginn_raven" else {}
    feed = torch.randint(1, cfg.vocab_size, (steps, B), generator=g)
    live = torch.tensor([1, 1, 0])[:, None]  # a finished row keeps being fed (masked) padding
    outs = {}
    with torch.no_grad():
        for name, cache in (("growing", model.new_cache()), ("static", model.new_cache(B, P + steps))):
            seq = [model.prefill(ids, cache, attention_mask=attn, position_ids=pos, **kw)[:, -1]]
            for t in range(steps):
                seq.append(model.decode_step(feed[t], cache, attention_mask=live, position_ids=lens[:, None] + t, **kw))
            outs[name] = torch.stack(seq)
            assert cache.length == P + steps
        assert isinstance(model.new_cache(), KVCache) and isinstance(model.new_cache(B, 8), StaticKVCache)
    torch.testing.assert_close(outs["static"], outs["growing"], rtol=0, atol=1e-5)


def test_static_cache_refuses_overflow() -> None:
    model = PROVIDERS["nanbeige"].build_actor(tiny_config("nanbeige"), seed=0)
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        model.prefill(torch.ones(1, 4, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="capacity 4 cannot take 1 more after 4"):
            model.decode_step(torch.ones(1, dtype=torch.long), cache)


@pytest.mark.parametrize("kind", ["huginn_raven", "nanbeige"])
def test_fused_kernels_match_eager(kind: str) -> None:
    """The engine's compiled norm/RoPE/gated-MLP (and add+norm, bias+RoPE) kernels compute what
    the eager ones do."""
    from hobson.models.common import fused_kernels

    cfg = tiny_config(kind)
    model = PROVIDERS[kind].build_actor(cfg, seed=1)
    ids = torch.randint(1, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = {"seed": [1, 2]} if kind == "huginn_raven" else {}
    with torch.no_grad():
        eager = model(ids, **kw)
        with fused_kernels(True):
            fused = model(ids, **kw)
    torch.testing.assert_close(fused, eager, rtol=0, atol=1e-5)


def test_a_failed_compile_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose toolchain cannot compile (e.g. no C compiler) still decodes, with a warning."""
    from hobson.models import common

    def no_toolchain(fn, **kw):
        def compiled(*args):
            raise RuntimeError("no C compiler")

        return compiled

    monkeypatch.setattr(common.torch, "compile", no_toolchain)
    monkeypatch.setattr(common, "_COMPILED", {})
    x, w = torch.randn(2, 3, 8), torch.rand(8)
    with pytest.warns(UserWarning, match="torch.compile of rms_norm failed"), common.fused_kernels(True):
        y = common.rms_norm(x, w, 1e-6)
    assert torch.equal(y, common.rms_norm.__wrapped__(x, w, 1e-6))


def test_gqa_decode_fold_equals_repeated_kv():
    """A decode step reads the KV cache in place (query heads folded into rows) instead of repeating it."""
    from hobson.models.common import attend

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, D = 3, 8, 2, 21, 16
    q = torch.randn(B, 1, H, D, generator=g).transpose(1, 2)  # (B, H, 1, D), not contiguous, as in the models
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    for mask in (torch.rand(B, 1, 1, S, generator=g) > 0.3, torch.ones(1, 1, 1, S, dtype=torch.bool)):
        mask[..., -1] = True
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), attn_mask=mask)
        out = attend(q, k, v, mask)
        assert out.shape == (B, H, 1, D)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    per_head = torch.rand(B, H, 1, S, generator=g) > 0.3  # a mask per query head cannot fold: repeated
    per_head[..., -1] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), attn_mask=per_head)
    torch.testing.assert_close(attend(q, k, v, per_head), ref, rtol=1e-6, atol=1e-6)


def test_the_mask_is_built_once_a_forward_and_only_when_asked() -> None:
    # the engine's decode kernel reads key_mask itself: a step whose layers never ask builds no mask
    cache = StaticKVCache(2, 6, "cpu")
    cache.prepare(torch.tensor([[1, 1, 1], [0, 1, 1]]), 2, 3, None)
    assert cache._mask is None
    mask = cache.mask()
    assert cache.mask() is mask and mask.shape == (2, 1, 3, 6)
    assert mask[1, 0].tolist() == [[True, False, False, False, False, False],  # a padded query sees itself
                                   [False, True, False, False, False, False],
                                   [False, True, True, False, False, False]]
    cache.advance(3)
    cache.prepare(None, 2, 1, None)  # the next forward: a new mask, built from its own positions
    assert cache._mask is None and cache.mask()[1, 0, 0].tolist() == [False, True, True, True, False, False]


@pytest.mark.parametrize("kind", ["huginn_raven", "nanbeige"])
def test_prefill_refuses_a_used_cache_and_a_decode_step_is_the_forwards_last_position(kind: str) -> None:
    """The engines' two calls (``CachedDecoding``): ``prefill`` only into an empty cache (one clear
    error, the cache untouched), and ``decode_step`` the full forward's output at the new position."""
    cfg = tiny_config(kind)
    model = PROVIDERS[kind].build_actor(cfg, seed=3)
    ids = torch.randint(1, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache()
        model.prefill(ids[:, :4], cache)
        with pytest.raises(ValueError, match="prefill needs an empty cache"):
            model.prefill(ids[:, :4], cache)
        assert cache.length == 4
        step = model.decode_step(ids[:, 4], cache)
        whole = model(ids)[:, -1]
    assert step.shape == whole.shape == (2, cfg.vocab_size)
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)
