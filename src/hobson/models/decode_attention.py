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

No atomics: every program sums in a fixed order, so a step gives the same bits on every run (graph
≡ eager, and a resumed RL run, depend on it). A plan may split the cache over ``split`` programs per
``(b, kv head)`` (flash-decoding's split): each writes its chunk's running maximum, sum and
unnormalised output in fp32, and a second kernel combines the chunks in chunk order. The chunks
are a function of the cache's capacity alone, never of timing, so the bits still repeat.

Only the rollout engine calls it (:func:`hobson.models.common.cache_attend`, inside
``fused_kernels()`` on CUDA, one query token); training, prefill and CPU attend as before.
``HOBSON_DECODE_ATTENTION=0`` turns it off. Needs triton (and a CUDA device, or
``TRITON_INTERPRET=1`` for the CPU test).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from hobson.models.triton_env import triton_available

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
    split: int = 1  # programs per (b, kv head), each over one chunk of the capacity; 1: one program, no combine

    def chunk(self, capacity: int) -> int:
        """Cache positions per program: the capacity over ``split`` programs, in whole blocks."""
        per = -(-capacity // self.split)
        return max(self.block, -(-per // self.block) * self.block)


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
    (one H200, session 26, ``bench/rl_gpu.py --kind huginn_raven --parts rollout``).

    No plan splits the cache: at batch 16 Huginn's 880 programs already fill the card, and on an
    H100 (session 32) a 3-way split took 33.34 µs against 30.98-31.73 whole at 176 positions and
    133.38 against 136.10 at 1,024; a Huginn decode step took 45.89 and 46.49 ms against 46.03 and
    46.26 whole. Issuing the cache's loads beside the key mask's instead of after it was slower
    still (36.45 µs at 176) and was removed. The split stays a plan field for batches of few
    programs (``HOBSON_DECODE_PLAN=split=N`` to measure one)."""
    if group == 1:
        p = Plan(block=64, warps=4, stages=2)
    elif dtype == torch.float32:
        p = Plan(block=64, warps=4, stages=3)
    else:
        p = Plan(block=64, warps=8, stages=3)
    override = _plan_override()
    return dataclasses.replace(p, **override) if override else p


@functools.cache
def _plan_override() -> dict:
    """``HOBSON_DECODE_PLAN="split=3,block=32"``: these fields of every plan replaced (a
    whole-step A/B of a launch choice; read once per process, so a graph and its eager steps agree)."""
    raw = os.environ.get("HOBSON_DECODE_PLAN")
    if raw is None:
        return {}
    fields = {f.name: f.type for f in dataclasses.fields(Plan)}
    out: dict = {}
    for item in raw.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in fields or not value.strip().isdigit():
            raise ValueError(f"HOBSON_DECODE_PLAN={raw!r}: give name=integer pairs, names from {sorted(fields)}")
        out[key] = bool(int(value)) if fields[key] in (bool, "bool") else int(value)
    if out.get("split", 1) < 1 or out.get("block", 16) < 16 or out.get("warps", 1) < 1 or out.get("stages", 1) < 1:
        raise ValueError(f"HOBSON_DECODE_PLAN={raw!r}: split, warps and stages are at least 1, block at least 16")
    return out


tl = None  # triton.language, imported with the kernel (a module global: Triton's interpreter patches those)


@functools.cache
def _kernel():  # noqa: ANN202 - a triton JIT function
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention(
        Q, KN, VN, KC, VC, MASK, POS, OUT, COS, SIN, PM, PL, PACC,
        sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, sm_b, so_b, so_h, sc_b, ss_b,
        scale,
        G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, BLOCK: tl.constexpr,
        ROPE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr, NCHUNK: tl.constexpr,
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
        if ROPE:  # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin cast to x's dtype first
            c1 = tl.load(COS + b * sc_b + d, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            c2 = tl.load(COS + b * sc_b + DH + d, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            s1 = tl.load(SIN + b * ss_b + d, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            s2 = tl.load(SIN + b * ss_b + DH + d, mask=dm, other=0.0).to(q1.dtype).to(tl.float32)
            a1, a2 = q1.to(tl.float32), q2.to(tl.float32)
            q1 = (a1 * c1[None, :] - a2 * s1[None, :]).to(q2.dtype)
            q2 = (a2 * c2[None, :] + a1 * s2[None, :]).to(q2.dtype)
            a1, a2 = k1.to(tl.float32), k2.to(tl.float32)
            k1 = (a1 * c1 - a2 * s1).to(k2.dtype)
            k2 = (a2 * c2 + a1 * s2).to(k2.dtype)
        kc_at = KC + b * skc_b + h * skc_h
        vc_at = VC + b * svc_b + h * svc_h
        # split: chunk c reads positions [c * CHUNK, (c + 1) * CHUNK) below pos; chunk 0 also
        # writes the new key and value and counts the new token (no program reads slot pos)
        c = tl.program_id(2)  # 0 without a split: the grid has one chunk, CHUNK the capacity
        first = c == 0
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, pos)
        tl.store(kc_at + pos * skc_s + d, k1, mask=dm & first)
        tl.store(kc_at + pos * skc_s + DH + d, k2, mask=dm & first)
        tl.store(vc_at + pos * svc_s + d, v1, mask=dm & first)
        tl.store(vc_at + pos * svc_s + DH + d, v2, mask=dm & first)
        # the new token first: its score starts the running maximum, so no row is ever all -inf;
        # another chunk starts from a finite floor, so a chunk whose keys are all masked stays NaN-free
        m = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1)
             + tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], axis=1)) * scale
        m = tl.where(first, m, -1e30)
        lsum = tl.where(first, tl.full([GP], 1.0, tl.float32), 0.0)
        acc1 = tl.zeros([GP, DHP], tl.float32) + tl.where(first, v1.to(tl.float32), 0.0)[None, :]
        acc2 = tl.zeros([GP, DHP], tl.float32) + tl.where(first, v2.to(tl.float32), 0.0)[None, :]
        for start in range(lo, hi, BLOCK):  # the filled prefix only, never the rest of the capacity
            s_idx = start + tl.arange(0, BLOCK)
            inside = s_idx < hi
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
        if NCHUNK > 1:  # the chunk's partial state, for combine(): (B, H, NCHUNK) and (B, H, NCHUNK, 2 * DHP)
            r_at = (b * (G * tl.num_programs(1)) + rows) * NCHUNK + c
            tl.store(PM + r_at, m, mask=gm)
            tl.store(PL + r_at, lsum, mask=gm)
            a_at = PACC + r_at[:, None] * (2 * DHP) + d[None, :]
            tl.store(a_at, acc1, mask=qm)
            tl.store(a_at + DHP, acc2, mask=qm)
        else:
            o_at = OUT + b * so_b + rows[:, None] * so_h + d[None, :]
            tl.store(o_at, (acc1 / lsum[:, None]).to(OUT.dtype.element_ty), mask=qm)
            tl.store(o_at + DH, (acc2 / lsum[:, None]).to(OUT.dtype.element_ty), mask=qm)

    @triton.jit
    def combine(PM, PL, PACC, OUT, so_b, so_h, H,
                DH: tl.constexpr, DHP: tl.constexpr, NCHUNK: tl.constexpr, NCP: tl.constexpr):
        # one program per (b, query head): the chunks' states merged in chunk order, fixed bits
        b = tl.program_id(0)
        h = tl.program_id(1)
        cs = tl.arange(0, NCP)
        d = tl.arange(0, DHP)
        # every chunk wrote its state; one past the write position has lsum 0 and a maximum of
        # -1e30, so its weight is 0, and chunk 0's new token keeps the maximum finite
        live = cs < NCHUNK
        r_at = (b * H + h) * NCHUNK + cs
        m = tl.load(PM + r_at, mask=live, other=-float("inf"))
        w = tl.exp(m - tl.max(m, axis=0))
        lsum = tl.sum(tl.load(PL + r_at, mask=live, other=0.0) * w, axis=0)
        a_at = PACC + r_at[:, None] * (2 * DHP) + d[None, :]
        am = live[:, None] & (d < DH)[None, :]
        o1 = tl.sum(tl.load(a_at, mask=am, other=0.0) * w[:, None], axis=0) / lsum
        o2 = tl.sum(tl.load(a_at + DHP, mask=am, other=0.0) * w[:, None], axis=0) / lsum
        o_at = OUT + b * so_b + h * so_h + d
        tl.store(o_at, o1.to(OUT.dtype.element_ty), mask=d < DH)
        tl.store(o_at + DH, o2.to(OUT.dtype.element_ty), mask=d < DH)

    return decode_attention, combine


def enabled() -> bool:
    return os.environ.get("HOBSON_DECODE_ATTENTION", "1") != "0" and triton_available()


def usable(q: Tensor, kcache: Tensor) -> bool:
    """One query token in the cache's dtype, a supported dtype, an even head size up to 256 (each
    half padded to a power of two inside the kernel), and whole groups of query heads per KV head."""
    return (q.shape[2] == 1 and q.dtype == kcache.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and q.shape[-1] <= 256 and q.shape[-1] % 2 == 0 and q.shape[1] % kcache.shape[1] == 0)


def attend(q: Tensor, k: Tensor, v: Tensor, kcache: Tensor, vcache: Tensor, key_mask: Tensor, pos: Tensor,
           rope: tuple[Tensor, Tensor] | None = None, p: Plan | None = None) -> Tensor:
    """Write ``k``, ``v`` ``(B, Hkv, 1, D)`` at cache slot ``pos`` (a one-element device tensor) of
    ``kcache``/``vcache`` ``(B, Hkv, capacity, D)`` and attend ``q`` ``(B, H, 1, D)`` over the slots
    before it that ``key_mask`` ``(B, capacity)`` allows, and itself. Returns ``(B, H, 1, D)`` (a
    view of a ``(B, 1, H, D)`` tensor, so the caller's transpose back is free).

    ``rope``: fp32 ``cos, sin`` ``(B, 1, D)``; ``q`` and ``k`` are then rotated (rotate-half, as
    :func:`hobson.models.nanbeige.apply_rope`) inside the kernel, before the key is stored, which
    saves the separate RoPE kernel of every layer. ``p`` overrides :func:`plan` (the bench's sweep).
    """
    B, H, _, D = q.shape
    hkv = kcache.shape[1]
    G = H // hkv
    for t in (q, k, v, kcache, vcache):
        if t.stride(-1) != 1:
            raise ValueError("decode attention needs the head dimension contiguous")
    if p is None:
        p = plan(G, D, q.dtype)
    out = torch.empty(B, 1, H, D, dtype=q.dtype, device=q.device)
    mask = key_mask.view(torch.uint8)
    cos, sin = rope if rope is not None else (q, q)  # unread without RoPE: any tensor will do
    for t in (cos, sin):
        if t.stride(-1) != 1:
            raise ValueError("decode attention needs cos/sin contiguous in the head dimension")
    pow2 = 1 << (D // 2 - 1).bit_length()
    dhp = max(16, pow2) if p.dot else pow2
    chunk = p.chunk(kcache.shape[2]) if p.split > 1 else kcache.shape[2]
    nchunk = -(-kcache.shape[2] // chunk)
    if nchunk > 1:
        pm = torch.empty(B, H, nchunk, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(B, H, nchunk, 2 * dhp, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = out  # unread and unwritten: any tensor will do
    attention, combine = _kernel()
    attention[(B, hkv, nchunk)](
        q, k, v, kcache, vcache, mask, pos, out, cos, sin, pm, pl, pacc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kcache.stride(0), kcache.stride(1), kcache.stride(2), vcache.stride(0), vcache.stride(1), vcache.stride(2),
        mask.stride(0), out.stride(0), out.stride(2), cos.stride(0), sin.stride(0),
        D ** -0.5,
        # tl.dot needs 16 rows and a reduction of at least 16: groups and half-heads padded to it
        G=G, GP=max(MIN_ROWS, 1 << (G - 1).bit_length()) if p.dot else 1 << (G - 1).bit_length(),
        DH=D // 2, DHP=dhp, BLOCK=p.block,
        ROPE=rope is not None, DOT=p.dot, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        CHUNK=chunk, NCHUNK=nchunk, num_warps=p.warps, num_stages=p.stages,
    )
    if nchunk > 1:
        combine[(B, H)](pm, pl, pacc, out, out.stride(0), out.stride(2), H,
                        DH=D // 2, DHP=dhp, NCHUNK=nchunk, NCP=1 << (nchunk - 1).bit_length(),
                        num_warps=1)
    return out.transpose(1, 2)
