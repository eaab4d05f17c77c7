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

Only the rollout engine calls it (inside ``fused_kernels()`` on CUDA, one query token:
:func:`hobson.models.common.decode_streams`); training, prefill and CPU attend as before. The
models' own decode steps also hand it their position encoding, so that kernel goes too: Nanbeige's
rotate-half RoPE, Huginn's ``qk_bias`` and interleaved RoPE (132 of Huginn's compiled
``bias_rope_qk`` kernels a step, 3.5 µs each on an H200).
``HOBSON_DECODE_ATTENTION=0`` turns it off. Needs triton (and a CUDA device, or
``TRITON_INTERPRET=1`` for the CPU test).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32  # cache positions per loop iteration (the default plan's)
MIN_ROWS = 16  # tl.dot's smallest tile side: the query heads of one KV head are padded to it


@dataclass(frozen=True)
class Plan:
    """One launch: cache positions per loop iteration, warps and pipeline stages per program, and
    whether the scores and the weighted sum run as ``tl.dot`` (the group of query heads padded to
    16 rows) or as elementwise products summed in fp32 (no padding: for one query head per KV head)."""

    block: int = BLOCK
    warps: int = 4
    stages: int = 3  # Triton's default
    dot: bool = True


def plan(group: int, head_dim: int, dtype: torch.dtype) -> Plan:
    """The launch for ``group`` query heads per KV head: a pure function of the shapes, never a
    timed autotune (a timing-dependent block would change the summation order, and the tokens).

    The best launches of ``bench/decode_attention.py``'s sweep (one H100, session 26; µs per layer
    call at 176 and 1,024 cached positions, batch 16, against the former 32-position, 4-warp plan):
    Nanbeige bf16 (6 heads per KV head) 64 positions, 8 warps, 3 stages: 9.07 against 10.07 µs at
    176 (128 positions were best at 1,024: 29.77 against 40.78); Nanbeige fp32 64/4/3: 27.48
    against 36.88, 117.10 against 174.68; Huginn bf16 (one head per KV head) 64/4/2: 30.44
    against 36.98, 126.61 against 168.87 (SDPA 140.58). 64 positions for every shape because the
    plan cannot see the cache length. ``tl.dot`` for every group, Huginn's one query head per KV
    head included: with elementwise products a Huginn decode step took 39.28 ms against 34.21 ms
    (one H200, session 26, ``bench/rl_gpu.py --kind huginn_raven --parts rollout``)."""
    if group == 1:
        return Plan(block=64, warps=4, stages=2)
    if dtype == torch.float32:
        return Plan(block=64, warps=4, stages=3)
    return Plan(block=64, warps=8, stages=3)


tl = None  # triton.language, imported with the kernel (a module global: Triton's interpreter patches those)


@functools.cache
def _kernel():  # noqa: ANN202 - a triton JIT function
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention(
        Q, KN, VN, KC, VC, MASK, POS, OUT, COS, SIN, BQ, BK,
        sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, sm_b, so_b, so_h, sc_b, ss_b,
        sc_e, sbq_h, sbk_h,
        scale,
        G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, BLOCK: tl.constexpr,
        ROPE: tl.constexpr, BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # the head dimension is handled as its two halves throughout: rotate-half RoPE pairs
        # element i with i + D/2, and the halves' products simply add up
        b = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(POS).to(tl.int32)
        g = tl.arange(0, GP)
        d = tl.arange(0, DHP)
        gm = g < G
        dm = d < DH
        rows = h * G + g
        qm = gm[:, None] & dm[None, :]
        q_at = Q + b * sq_b + rows[:, None] * sq_h + d[None, :]
        q1 = tl.load(q_at, mask=qm, other=0.0)
        q2 = tl.load(q_at + DH, mask=qm, other=0.0)
        k1 = tl.load(KN + b * sk_b + h * sk_h + d, mask=dm, other=0.0)
        k2 = tl.load(KN + b * sk_b + h * sk_h + DH + d, mask=dm, other=0.0)
        v1 = tl.load(VN + b * sv_b + h * sv_h + d, mask=dm, other=0.0)
        v2 = tl.load(VN + b * sv_b + h * sv_h + DH + d, mask=dm, other=0.0)
        if ROPE == 2:  # interleaved pairs (2i, 2i+1), within each half as DH is even: each element's partner
            dp = d ^ 1
            q1p = tl.load(q_at - d[None, :] + dp[None, :], mask=qm, other=0.0)
            q2p = tl.load(q_at - d[None, :] + DH + dp[None, :], mask=qm, other=0.0)
            k1p = tl.load(KN + b * sk_b + h * sk_h + dp, mask=dm, other=0.0)
            k2p = tl.load(KN + b * sk_b + h * sk_h + DH + dp, mask=dm, other=0.0)
        if BIAS:  # Huginn's qk_bias, added in fp32 and rounded to the input's dtype (a 16-bit tensor add)
            bq_at = BQ + rows[:, None] * sbq_h + d[None, :]
            bk_at = BK + h * sbk_h + d
            q1 = (q1.to(tl.float32) + tl.load(bq_at, mask=qm, other=0.0).to(tl.float32)).to(q1.dtype)
            q2 = (q2.to(tl.float32) + tl.load(bq_at + DH, mask=qm, other=0.0).to(tl.float32)).to(q2.dtype)
            k1 = (k1.to(tl.float32) + tl.load(bk_at, mask=dm, other=0.0).to(tl.float32)).to(k1.dtype)
            k2 = (k2.to(tl.float32) + tl.load(bk_at + DH, mask=dm, other=0.0).to(tl.float32)).to(k2.dtype)
            if ROPE == 2:
                bq_p = BQ + rows[:, None] * sbq_h + dp[None, :]
                bk_p = BK + h * sbk_h + dp
                q1p = (q1p.to(tl.float32) + tl.load(bq_p, mask=qm, other=0.0).to(tl.float32)).to(q1.dtype)
                q2p = (q2p.to(tl.float32) + tl.load(bq_p + DH, mask=qm, other=0.0).to(tl.float32)).to(q2.dtype)
                k1p = (k1p.to(tl.float32) + tl.load(bk_p, mask=dm, other=0.0).to(tl.float32)).to(k1.dtype)
                k2p = (k2p.to(tl.float32) + tl.load(bk_p + DH, mask=dm, other=0.0).to(tl.float32)).to(k2.dtype)
        if ROPE == 2:  # Huginn's apply_rope: x[2i] cos_i - x[2i+1] sin_i, x[2i+1] cos_i + x[2i] sin_i, fp32 table
            i1 = d // 2
            i2 = (DH + d) // 2
            c1 = tl.load(COS + b * sc_b + i1 * sc_e, mask=dm, other=0.0)
            c2 = tl.load(COS + b * sc_b + i2 * sc_e, mask=dm, other=0.0)
            s1 = tl.load(SIN + b * ss_b + i1 * sc_e, mask=dm, other=0.0)
            s2 = tl.load(SIN + b * ss_b + i2 * sc_e, mask=dm, other=0.0)
            sgn = tl.where(d % 2 == 0, -1.0, 1.0)  # the partner's sign: minus for the even element
            s1 = s1 * sgn
            s2 = s2 * sgn
            q1 = (q1.to(tl.float32) * c1[None, :] + q1p.to(tl.float32) * s1[None, :]).to(q2.dtype)
            q2 = (q2.to(tl.float32) * c2[None, :] + q2p.to(tl.float32) * s2[None, :]).to(q2.dtype)
            k1 = (k1.to(tl.float32) * c1 + k1p.to(tl.float32) * s1).to(k2.dtype)
            k2 = (k2.to(tl.float32) * c2 + k2p.to(tl.float32) * s2).to(k2.dtype)
        if ROPE == 1:  # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin cast to x's dtype first
            c1 = tl.load(COS + b * sc_b + d * sc_e, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            c2 = tl.load(COS + b * sc_b + (DH + d) * sc_e, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            s1 = tl.load(SIN + b * ss_b + d * sc_e, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            s2 = tl.load(SIN + b * ss_b + (DH + d) * sc_e, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            a1, a2 = q1.to(tl.float32), q2.to(tl.float32)
            q1 = (a1 * c1[None, :] - a2 * s1[None, :]).to(q2.dtype)
            q2 = (a2 * c2[None, :] + a1 * s2[None, :]).to(q2.dtype)
            a1, a2 = k1.to(tl.float32), k2.to(tl.float32)
            k1 = (a1 * c1 - a2 * s1).to(k2.dtype)
            k2 = (a2 * c2 + a1 * s2).to(k2.dtype)
        kc_at = KC + b * skc_b + h * skc_h
        vc_at = VC + b * svc_b + h * svc_h
        tl.store(kc_at + pos * skc_s + d, k1, mask=dm)
        tl.store(kc_at + pos * skc_s + DH + d, k2, mask=dm)
        tl.store(vc_at + pos * svc_s + d, v1, mask=dm)
        tl.store(vc_at + pos * svc_s + DH + d, v2, mask=dm)
        # the new token first: its score starts the running maximum, so no row is ever all -inf
        m = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1)
             + tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], axis=1)) * scale
        lsum = tl.full([GP], 1.0, tl.float32)
        acc1 = tl.zeros([GP, DHP], tl.float32) + v1.to(tl.float32)[None, :]
        acc2 = tl.zeros([GP, DHP], tl.float32) + v2.to(tl.float32)[None, :]
        for start in range(0, pos, BLOCK):  # the filled prefix only, never the rest of the capacity
            s_idx = start + tl.arange(0, BLOCK)
            inside = s_idx < pos
            allowed = inside & (tl.load(MASK + b * sm_b + s_idx, mask=inside, other=0) != 0)
            kv_mask = allowed[:, None] & dm[None, :]
            kb1 = tl.load(kc_at + s_idx[:, None] * skc_s + d[None, :], mask=kv_mask, other=0.0)
            kb2 = tl.load(kc_at + s_idx[:, None] * skc_s + DH + d[None, :], mask=kv_mask, other=0.0)
            if DOT:
                s = (tl.dot(q1, tl.trans(kb1), input_precision=PRECISION)
                     + tl.dot(q2, tl.trans(kb2), input_precision=PRECISION)) * scale  # (GP, BLOCK)
            else:
                s = (tl.sum(q1.to(tl.float32)[:, None, :] * kb1.to(tl.float32)[None, :, :], axis=2)
                     + tl.sum(q2.to(tl.float32)[:, None, :] * kb2.to(tl.float32)[None, :, :], axis=2)) * scale
            s = tl.where(allowed[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            vb1 = tl.load(vc_at + s_idx[:, None] * svc_s + d[None, :], mask=kv_mask, other=0.0)
            vb2 = tl.load(vc_at + s_idx[:, None] * svc_s + DH + d[None, :], mask=kv_mask, other=0.0)
            if DOT:
                pv = p.to(vb1.dtype)
                acc1 = acc1 * alpha[:, None] + tl.dot(pv, vb1, input_precision=PRECISION)
                acc2 = acc2 * alpha[:, None] + tl.dot(pv, vb2, input_precision=PRECISION)
            else:
                acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * vb1.to(tl.float32)[None, :, :], axis=1)
                acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * vb2.to(tl.float32)[None, :, :], axis=1)
            m = m_new
        o_at = OUT + b * so_b + rows[:, None] * so_h + d[None, :]
        tl.store(o_at, (acc1 / lsum[:, None]).to(OUT.dtype.element_ty), mask=qm)
        tl.store(o_at + DH, (acc2 / lsum[:, None]).to(OUT.dtype.element_ty), mask=qm)

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
    """One query token in the cache's dtype, a supported dtype, an even head size up to 256 (each
    half padded to a power of two inside the kernel), and whole groups of query heads per KV head."""
    return (q.shape[2] == 1 and q.dtype == kcache.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and q.shape[-1] <= 256 and q.shape[-1] % 2 == 0 and q.shape[1] % kcache.shape[1] == 0)


def attend(q: Tensor, k: Tensor, v: Tensor, kcache: Tensor, vcache: Tensor, key_mask: Tensor, pos: Tensor,
           rope: tuple[Tensor, Tensor] | None = None, p: Plan | None = None, *, interleaved: bool = False,
           bias: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Write ``k``, ``v`` ``(B, Hkv, 1, D)`` at cache slot ``pos`` (a one-element device tensor) of
    ``kcache``/``vcache`` ``(B, Hkv, capacity, D)`` and attend ``q`` ``(B, H, 1, D)`` over the slots
    before it that ``key_mask`` ``(B, capacity)`` allows, and itself. Returns ``(B, H, 1, D)`` (a
    view of a ``(B, 1, H, D)`` tensor, so the caller's transpose back is free).

    ``rope``: fp32 ``cos, sin``; ``q`` and ``k`` are then rotated inside the kernel, before the key
    is stored, which saves the separate RoPE kernel of every layer. Rotate-half (as
    :func:`hobson.models.nanbeige.apply_rope`, cos/sin ``(B, 1, D)`` rounded to ``q``'s dtype
    first) or, with ``interleaved``, pairs ``(2i, 2i+1)`` (as :func:`hobson.models.huginn.apply_rope`,
    cos/sin ``(B, D/2)`` used in fp32, any equal stride: views of Huginn's ``freqs_cis`` rows).
    ``bias``: ``(H, D)`` and ``(Hkv, D)`` added to ``q`` and ``k`` before the rotation, each sum
    rounded to ``q``'s dtype (Huginn's ``qk_bias``). ``p`` overrides :func:`plan` (the bench's sweep).
    """
    B, H, _, D = q.shape
    hkv = kcache.shape[1]
    G = H // hkv
    for t in (q, k, v, kcache, vcache):
        if t.stride(-1) != 1:
            raise ValueError("decode attention needs the head dimension contiguous")
    if interleaved and (rope is None or D % 4):
        raise ValueError("interleaved RoPE in decode attention needs cos/sin and a head size divisible by 4")
    if p is None:
        p = plan(G, D, q.dtype)
    out = torch.empty(B, 1, H, D, dtype=q.dtype, device=q.device)
    mask = key_mask.view(torch.uint8)
    cos, sin = rope if rope is not None else (q, q)  # unread without RoPE: any tensor will do
    if cos.stride(-1) != sin.stride(-1):
        raise ValueError("decode attention needs cos and sin with the same stride")
    bq, bk = bias if bias is not None else (q, q)  # unread without a bias
    for t in (bq, bk):
        if t.stride(-1) != 1:
            raise ValueError("decode attention needs the bias contiguous in the head dimension")
    pow2 = 1 << (D // 2 - 1).bit_length()
    _kernel()[(B, hkv)](
        q, k, v, kcache, vcache, mask, pos, out, cos, sin, bq, bk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kcache.stride(0), kcache.stride(1), kcache.stride(2), vcache.stride(0), vcache.stride(1), vcache.stride(2),
        mask.stride(0), out.stride(0), out.stride(2), cos.stride(0), sin.stride(0),
        cos.stride(-1), bq.stride(0), bk.stride(0),
        D ** -0.5,
        # tl.dot needs 16 rows and a reduction of at least 16: groups and half-heads padded to it
        G=G, GP=max(MIN_ROWS, 1 << (G - 1).bit_length()) if p.dot else 1 << (G - 1).bit_length(),
        DH=D // 2, DHP=max(16, pow2) if p.dot else pow2, BLOCK=p.block,
        ROPE=0 if rope is None else 2 if interleaved else 1, BIAS=bias is not None, DOT=p.dot,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=p.warps, num_stages=p.stages,
    )
    return out.transpose(1, 2)
