"""One decode step's attention through the kernel and through the path it replaces, on identical caches
(shared by the CPU test, under Triton's interpreter, and the GPU test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hobson.models import decode_attention
from hobson.models.common import StaticKVCache, attend
from hobson.models.nanbeige import apply_rope, rope_cos_sin


def reference_and_kernel(B: int, H: int, hkv: int, D: int, cap: int, pos: int, dtype: torch.dtype, device: str,
                         seed: int = 0, rope: bool = False, plan: decode_attention.Plan | None = None
                         ) -> tuple[tuple, tuple]:
    """One decode step at write position ``pos`` through both paths, on identical caches that hold
    random keys before ``pos`` and garbage (stale values of an earlier prompt) after it.

    ``rope``: the reference rotates ``q`` and ``k`` with Nanbeige's :func:`apply_rope` (eager) at
    position ``pos`` before the cache update; the kernel rotates them itself. ``plan``: the kernel's
    launch (default :func:`decode_attention.plan`)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rnd(B, H, 1, D), rnd(B, hkv, 1, D), rnd(B, hkv, 1, D)
    kc, vc = rnd(B, hkv, cap, D) * 3, rnd(B, hkv, cap, D) * 3
    key_mask = torch.rand(B, cap, generator=g) < 0.7  # padding and finished rows: keys never attended
    key_mask[0, :pos] = True
    key_mask = key_mask.to(device)
    cos, sin = rope_cos_sin(torch.full((B, 1), pos, device=device), D, 70_000_000.0 if D > 64 else 10_000.0)
    outs = []
    for fused in (False, True):
        cache = StaticKVCache(B, cap, device)
        cache.streams["s"] = (kc.clone(), vc.clone())
        cache.write_pos.fill_(pos)
        cache.length = pos
        cache.key_mask.copy_(key_mask)
        cache.prepare(torch.ones(B, 1, dtype=torch.long), B, 1, None)
        if fused:
            kb, vb = cache.streams["s"]
            y = decode_attention.attend(q, k, v, kb, vb, cache.key_mask, cache._new,
                                        rope=(cos, sin) if rope else None, p=plan)
        else:
            qr, kr = (apply_rope(q, cos, sin), apply_rope(k, cos, sin)) if rope else (q, k)
            kb, vb = cache.update("s", kr, v)
            y = attend(qr, kb, vb, cache.mask())
        outs.append((y, *cache.streams["s"]))
    return outs[0], outs[1]


def split_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode-attention call splits its cache over three programs per KV head (16-position
    blocks, so a tiny engine's ~36-slot cache really is split), combined by the second kernel."""
    plan = decode_attention.plan
    monkeypatch.setattr(decode_attention, "plan",
                        lambda *a: dataclasses.replace(plan(*a), block=16, split=3))
