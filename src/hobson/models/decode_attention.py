"""One decode step's attention over a fixed-capacity KV cache, as one Triton kernel.

A decode step attends with one query token per row. Through ``scaled_dot_product_attention`` that
was, per layer: two ``index_copy_`` kernels writing the new key and value into the cache, a mask
expanded over the folded query heads, and an SDPA kernel over the cache's whole capacity, masked
slots included: ~12 µs a layer for Nanbeige at batch 16 on an H200 (the cuDNN flash kernel; 0.53 ms
of a token's 6.5 ms, ``bench/rl_gpu.py --profile``, session 12), 44 layers a step (22 layers × 2
loops), and 132 for Huginn (prelude, 32 recurrences × 4 core layers, coda).

This kernel does a layer's part in one launch: program ``(b, kv head)`` writes the new key and
value at the cache's write position, then attends its ``H / Hkv`` query heads over the positions
before it that the key mask allows, plus the new token itself (always allowed, as in
:meth:`hobson.models.common.StaticKVCache.prepare`). It reads only the filled prefix (the loop
bound is the write position, read on the device, so a captured CUDA graph replays it for every
step), never the rest of the capacity. The new key and value enter from registers, so no program
reads what it wrote. Online softmax in fp32 (flash-decoding's recurrence), products on the matrix
units: fp32 inputs as plain fp32 FMAs (``ieee``), 16-bit inputs as 16-bit products with fp32
sums, and the weights cast to the value dtype before the second product, as flash attention does.

No atomics and no split of the sequence over programs: every program sums in a fixed order, so a
step gives the same bits on every run (graph ≡ eager, and a resumed RL run, depend on it).

Only the rollout engine calls it (:func:`hobson.models.common.cache_attend`, inside
``fused_kernels()`` on CUDA, one query token); training, prefill and CPU attend as before.
``HOBSON_DECODE_ATTENTION=0`` turns it off. Needs triton (and a CUDA device, or
``TRITON_INTERPRET=1`` for the CPU test).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

BLOCK = 32  # cache positions per loop iteration
MIN_ROWS = 16  # tl.dot's smallest tile side: the query heads of one KV head are padded to it


tl = None  # triton.language, imported with the kernel (a module global: Triton's interpreter patches those)


@functools.cache
def _kernel():  # noqa: ANN202 - a triton JIT function
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention(
        Q, KN, VN, KC, VC, MASK, POS, OUT,
        sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, sm_b, so_b, so_h,
        scale,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(POS).to(tl.int32)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        rows = h * G + g
        q = tl.load(Q + b * sq_b + rows[:, None] * sq_h + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        kn = tl.load(KN + b * sk_b + h * sk_h + d, mask=dm, other=0.0)
        vn = tl.load(VN + b * sv_b + h * sv_h + d, mask=dm, other=0.0)
        tl.store(KC + b * skc_b + h * skc_h + pos * skc_s + d, kn, mask=dm)
        tl.store(VC + b * svc_b + h * svc_h + pos * svc_s + d, vn, mask=dm)
        # the new token first: its score starts the running maximum, so no row is ever all -inf
        m = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale
        lsum = tl.full([GP], 1.0, tl.float32)
        acc = tl.zeros([GP, DP], tl.float32) + vn.to(tl.float32)[None, :]
        for start in range(0, pos, BLOCK):  # the filled prefix only, never the rest of the capacity
            s_idx = start + tl.arange(0, BLOCK)
            inside = s_idx < pos
            allowed = inside & (tl.load(MASK + b * sm_b + s_idx, mask=inside, other=0) != 0)
            kv_mask = allowed[:, None] & dm[None, :]
            k = tl.load(KC + b * skc_b + h * skc_h + s_idx[:, None] * skc_s + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (GP, BLOCK)
            s = tl.where(allowed[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            v = tl.load(VC + b * svc_b + h * svc_h + s_idx[:, None] * svc_s + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / lsum[:, None]
        tl.store(OUT + b * so_b + rows[:, None] * so_h + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])

    return decode_attention


def enabled() -> bool:
    if os.environ.get("HOBSON_DECODE_ATTENTION", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def usable(q: Tensor, kcache: Tensor) -> bool:
    """One query token in the cache's dtype, a supported dtype, a head size up to 256 (padded to a
    power of two inside the kernel), and whole groups of query heads per KV head."""
    return (q.shape[2] == 1 and q.dtype == kcache.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and q.shape[-1] <= 256 and q.shape[1] % kcache.shape[1] == 0)


def attend(q: Tensor, k: Tensor, v: Tensor, kcache: Tensor, vcache: Tensor, key_mask: Tensor, pos: Tensor) -> Tensor:
    """Write ``k``, ``v`` ``(B, Hkv, 1, D)`` at cache slot ``pos`` (a one-element device tensor) of
    ``kcache``/``vcache`` ``(B, Hkv, capacity, D)`` and attend ``q`` ``(B, H, 1, D)`` over the slots
    before it that ``key_mask`` ``(B, capacity)`` allows, and itself. Returns ``(B, H, 1, D)`` (a
    view of a ``(B, 1, H, D)`` tensor, so the caller's transpose back is free)."""
    B, H, _, D = q.shape
    hkv = kcache.shape[1]
    G = H // hkv
    for t in (q, k, v, kcache, vcache):
        if t.stride(-1) != 1:
            raise ValueError("decode attention needs the head dimension contiguous")
    out = torch.empty(B, 1, H, D, dtype=q.dtype, device=q.device)
    mask = key_mask.view(torch.uint8)
    dp = max(16, 1 << (D - 1).bit_length())
    _kernel()[(B, hkv)](
        q, k, v, kcache, vcache, mask, pos, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kcache.stride(0), kcache.stride(1), kcache.stride(2), vcache.stride(0), vcache.stride(1), vcache.stride(2),
        mask.stride(0), out.stride(0), out.stride(2),
        D ** -0.5,
        G=G, GP=max(MIN_ROWS, 1 << (G - 1).bit_length()), D=D, DP=dp, BLOCK=BLOCK,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out.transpose(1, 2)
