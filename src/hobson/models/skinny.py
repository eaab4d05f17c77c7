"""Weight-streaming GEMMs for decoding: ``x @ W.T`` when ``x`` has at most 16 rows.

A decode step at batch 16 is a chain of such products (``M = 16`` rows against a weight of
``N × K``): each reads its whole weight once and does little arithmetic on it, so the memory
bandwidth should set its speed. ``bench/skinny_gemm.py`` timed them at the official shapes on an
H200 (docs/BENCHMARKS.md, "GPU: decode, 2026-12-02 (session 12)"):

- bf16/fp16: cuBLAS reads the weights at 63-103% of the measured copy speed, and this kernel
  was no faster (its best split per shape from 6% faster to 11% slower; in a whole Nanbeige
  decode step 9.4 against cuBLAS's 7.4 ms). 16-bit products stay with cuBLAS (:func:`plan` returns None).
- fp32 (Nanbeige's RL precision): cuBLAS reaches 27-45%; a Nanbeige step's fp32 products took
  19.5 ms against a 6.5 ms floor. Here fp32 products run on the tensor cores as "3xTF32"
  (``input_precision="tf32x3"``: each operand split into a TF32 high and low part, three TF32
  products summed in fp32), which keeps fp32's accuracy, not TF32's ~1e-3: 2.2-2.4e-7 relative
  to a float64 product, against cuBLAS fp32's 5e-7-1e-6 on the same inputs; the products ran
  2.3-3.1x faster than cuBLAS (19.5 -> 7.6 ms per Nanbeige step). Plain fp32 FMAs (``ieee``) were
  1.5-2.4x slower than cuBLAS.

The kernel computes ``Wᵀ``'s tiles against the 16 rows (a ``BLOCK_N × BLOCK_K`` tile of ``W`` times
a ``BLOCK_K × 16`` tile of ``xᵀ``, so the matrix units see the weight rows as their long side) and
splits ``K`` over programs where ``N`` alone gives too few to fill the chip. Split-K partial sums
go to an fp32 workspace and a second kernel adds them in a fixed order: no atomics, so the result
is the same bits on every run (the engine's graph ≡ eager test and a resumed RL run depend on it).

The launch configuration is a pure function of ``(N, K, dtype, multiprocessor count)``, never a
timed autotune, for the same reason: a timing-dependent choice would change the summation order,
and so the sampled tokens, from one process to the next.

Only the rollout engine calls this (through :func:`hobson.models.common.linear`, inside
``fused_kernels()``); training and every CPU path use ``torch.nn.functional.linear`` unchanged.
``HOBSON_SKINNY_GEMM=0`` turns it off. Needs triton and a CUDA device.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from hobson.models.triton_env import triton_available

MAX_ROWS = 16  # the kernel's row block: one tile holds every row of a batch-16 decode step
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Plan:
    """One launch: tile sizes, how many programs share ``K``, the warps/stages per program, and
    (fp32 inputs) how ``tl.dot`` multiplies them."""

    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int
    precision: str = "tf32x3"  # ignored for 16-bit inputs


def enabled() -> bool:
    return os.environ.get("HOBSON_SKINNY_GEMM", "1") != "0"


def usable(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`linear` takes this product: CUDA, ≤ 16 rows, matching 16-bit or fp32 dtypes,
    and a plan that the measurements favoured over cuBLAS (:func:`plan` returns None otherwise)."""
    if not (x.is_cuda and enabled() and triton_available()):
        return False
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype or x.dtype not in _DTYPES:
        return False
    if weight.stride(1) != 1 or x.numel() == 0 or x.numel() // x.shape[-1] > MAX_ROWS:
        return False
    return plan(weight.shape[0], weight.shape[1], x.dtype, _sm_count(x.device)) is not None


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# 16-bit decode products that measured faster off cuBLAS's default choice, per card (the name
# torch.cuda.get_device_name gives): (N, K, dtype) -> route, in the bench's labels ("cublaslt",
# "cublas swapped", "cublaslt swapped", "triton", or a swept "triton BNxBK sS stT"). A card not here,
# or a shape not in its table, stays with cuBLAS: the best kernel for a shape differs from card to
# card. HOBSON_GEMM16_ROUTES names a JSON list of {"n", "k", "dtype", "route"} that replaces the
# table on any card (how bench/decode_routes.py tries one); HOBSON_GEMM16_ROUTES=none, cuBLAS for all.
# An H200's Nanbeige table (session 31, bench/decode_routes.py --models nanbeige --repeat 3): a bf16
# decode step 4.92, 4.93, 4.94 ms with these routes against 5.16, 5.18, 5.26 with cuBLAS, runs
# interleaved in one call (1.05x; docs/BENCHMARKS.md, bench/results/gpu-2026-12-07-s31/). None for an
# H100: there the per-shape winners (3-8% each, timed alone) gave a Nanbeige step 1.05x on one
# machine and 0.96x on another, Huginn 1.01x (session 30): no reliable gain in a whole step.
ROUTES_16BIT: dict[str, dict[tuple[int, int, str], str]] = {
    "NVIDIA H200": {
        (3072, 6144, "bfloat16"): "triton",  # Nanbeige o: 13.5 against cuBLAS's 14.3 µs
        (21504, 3072, "bfloat16"): "triton 64x128 s1 st3",  # gate|up: 33.3 / 35.5
        (3072, 10752, "bfloat16"): "triton 64x128 s4 st4",  # down: 20.3 / 21.5
        (166144, 3072, "bfloat16"): "triton",  # lm_head: 234.9 / 245.2
    },
}


_ROUTE = re.compile(r"(cublas|cublaslt|cublas swapped|cublaslt swapped|triton|triton \d+x\d+ s\d+ st\d+)")


@functools.cache
def _card(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.cache
def _routes(card: str) -> dict[tuple[int, int, str], str]:
    """The route table of ``card``: ROUTES_16BIT's, or the file HOBSON_GEMM16_ROUTES names (``none``:
    an empty table), read when first needed."""
    path = os.environ.get("HOBSON_GEMM16_ROUTES")
    if not path:
        return ROUTES_16BIT.get(card, {})
    return {} if path == "none" else read_routes(path)


def read_routes(path: str) -> dict[tuple[int, int, str], str]:
    """A route table file, checked entry by entry (a bad table is one error naming the file and each
    bad entry, not a failure mid-decode)."""
    import json

    from hobson.errors import ConfigError

    where = f"HOBSON_GEMM16_ROUTES={path}" if os.environ.get("HOBSON_GEMM16_ROUTES") == path else path
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: not a readable JSON file ({e})") from None
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: expected a JSON list of {{n, k, dtype, route}}")
    table, problems = {}, []
    for i, r in enumerate(entries):
        ok = (isinstance(r, dict) and isinstance(r.get("n"), int) and isinstance(r.get("k"), int)
              and r.get("dtype") in ("bfloat16", "float16") and isinstance(r.get("route"), str)
              and _ROUTE.fullmatch(r["route"]) is not None)
        if not ok:
            problems.append(f"entry {i} ({r!r}): needs integer n and k, dtype bfloat16 or float16, and a route "
                            "of cublas, cublaslt, cublas swapped, cublaslt swapped, triton or 'triton BNxBK sS stT'")
            continue
        table[(r["n"], r["k"], r["dtype"])] = r["route"]
    if problems:
        raise ConfigError(f"{where}:\n" + "\n".join(problems))
    return table


def route(x: Tensor, weight: Tensor) -> str | None:
    """The 16-bit route for this product if it is not cuBLAS's default, else None."""
    if x.dtype == torch.float32 or not (x.is_cuda and enabled()) or weight.dim() != 2:
        return None
    if x.dtype != weight.dtype or x.numel() // max(x.shape[-1], 1) > MAX_ROWS:
        return None
    r = _routes(_card(x.device)).get((weight.shape[0], weight.shape[1], str(x.dtype).removeprefix("torch.")))
    if r is None or r == "cublas" or (r.startswith("triton") and not triton_available()):
        return None
    return r


def parse_triton(label: str, n: int, k: int, dtype: torch.dtype, sms: int) -> Plan:
    """A bench label ("triton", or "triton 64x128 s4 st4") as a launch."""
    base = tile_plan(n, k, dtype, sms)
    parts = label.split()
    if len(parts) == 1:
        return base
    bn, bk = (int(v) for v in parts[1].split("x"))
    return Plan(bn, bk, int(parts[2][1:]), base.warps, int(parts[3][2:]))


def routed(x: Tensor, weight: Tensor, r: str) -> Tensor:
    """``x @ weight.T`` by route ``r`` (see ROUTES_16BIT)."""
    if r.startswith("triton"):
        return linear(x, weight, parse_triton(r, weight.shape[0], weight.shape[1], x.dtype, _sm_count(x.device)))
    lib = "cublaslt" if r.startswith("cublaslt") else None
    prev = torch.backends.cuda.preferred_blas_library()
    if lib:
        torch.backends.cuda.preferred_blas_library(lib)
    try:
        if r.endswith("swapped"):
            x2 = x.reshape(-1, x.shape[-1])
            # cuBLAS sees the 16 rows as its N: other kernels. The result comes transposed; the
            # layers after it (a head split, the attention kernel) need rows contiguous: one copy
            return torch.mm(weight, x2.T).T.contiguous().view(*x.shape[:-1], weight.shape[0])
        return torch.nn.functional.linear(x, weight)
    finally:
        if lib:
            torch.backends.cuda.preferred_blas_library(prev)


def plan(n: int, k: int, dtype: torch.dtype, sms: int) -> Plan | None:
    """The launch for an ``N × K`` weight, or None where cuBLAS is kept (16-bit: measured as fast)."""
    if dtype != torch.float32:
        return None
    return tile_plan(n, k, dtype, sms)


def tile_plan(n: int, k: int, dtype: torch.dtype, sms: int) -> Plan:
    """The kernel's launch for any dtype (the bench and tests also run it on 16-bit inputs).

    64 weight rows per program and 16 KB of weight per pipeline stage; ``K`` split in two until
    there are at least 1.5 programs per multiprocessor (more resident programs keep more loads in
    flight), while each program still streams at least 8 tiles of ``K`` (fewer do not hide the
    pipeline's start). On the H200's 132 multiprocessors this picked the fastest of the swept
    splits for every Nanbeige fp32 shape (``bench/skinny_gemm.py --sweep``; q/k/v: 2, o and down: 8).
    """
    if dtype == torch.float32:
        block_n, block_k, warps, stages = 64, 64, 4, 4
    else:
        block_n, block_k, warps, stages = 64, 128, 4, 4
    tiles = _cdiv(n, block_n)
    split = 1
    while 2 * tiles * split < 3 * sms and k // (2 * split) >= 8 * block_k:
        split *= 2
    return Plan(block_n, block_k, split, warps, stages)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels():  # noqa: ANN202 - triton objects; built on first use, so importing this needs no triton
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
             K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN: tl.constexpr, PRECISION: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        k_lo = pid_s * K_SPLIT
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
        x_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, K_SPLIT, BLOCK_K):
            if EVEN:  # every tile full: no mask on the weight, the stream the kernel exists for
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=rm[None, :] < M, other=0.0)
            else:
                kk = k_lo + k + rk
                w = tl.load(w_ptrs, mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
                x = tl.load(x_ptrs, mask=(rm[None, :] < M) & (kk[:, None] < K), other=0.0)
            acc += tl.dot(w, x, input_precision=PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y_ptrs = y_ptr + pid_s * stride_ys + rm[None, :] * stride_ym + rn[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))

    @triton.jit
    def sum_splits(ws_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # a fixed order: the same bits every run
            acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    return gemm, sum_splits


def linear(x: Tensor, weight: Tensor, p: Plan | None = None) -> Tensor:
    """``x @ weight.T`` (``F.linear`` without bias) for ``x`` ``(..., K)`` of at most 16 rows.

    fp32 accumulation, rounded once to the input dtype, as cuBLAS does; fp32 inputs are multiplied
    as ``p.precision`` says (3xTF32 by default: fp32 accuracy), never as plain TF32. ``p``
    overrides :func:`plan` (the bench's sweep, and 16-bit inputs, which :func:`plan` leaves to cuBLAS).
    """
    gemm, sum_splits = _kernels()
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if p is None:
        p = plan(n, k, x.dtype, _sm_count(x.device))
        assert p is not None, "usable() said no plan"
    k_split = _cdiv(_cdiv(k, p.split), p.block_k) * p.block_k  # K per program, whole tiles
    split = _cdiv(k, k_split)
    even = n % p.block_n == 0 and k % k_split == 0
    precision = p.precision if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (_cdiv(n, p.block_n), split)
    gemm[grid](x2, weight, out, m, n, k, x2.stride(0), weight.stride(0), n, m * n,
               K_SPLIT=k_split, BLOCK_M=MAX_ROWS, BLOCK_N=p.block_n, BLOCK_K=p.block_k, EVEN=even, PRECISION=precision,
               num_warps=p.warps, num_stages=p.stages)
    if split > 1:
        block = 1024
        sum_splits[(_cdiv(m * n, block),)](out, y, m * n, SPLIT=split, BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], n)
