"""A decode step's residual add and RMSNorms as one Triton kernel, each row held by one program.

Why: inductor compiles a norm over Huginn's 5,280-wide rows as a looped reduction (its persistent
form stops at 1,024 columns), so at 16 rows a call is 16 programs that each walk their row once
per reduction and once more for the output: 3.85 µs a call on an H200, 264 calls a decode step
(session 25's profile). Here a program loads each input row once, keeps it in registers through
both reductions and stores each output once.

Two chains, both ``(rows, N)`` with the weights ``(N,)`` in the rows' dtype:

- ``add_norm(a, b, w)``: ``s = a + b`` and ``rms_norm(s, w)`` (:func:`hobson.models.common.add_rms_norm`);
- ``sandwich(a, b, w1, w2)``: ``y = rms_norm(a + b, w1)`` and ``rms_norm(y, w2)``
  (:func:`hobson.models.huginn.sandwich_norms`).

The rounding follows the eager ops: the add is rounded to the dtype, each normalised row is
rounded before the weight's product, and the product is rounded again. Only the order of the
fp32 sum of squares differs from eager (and from inductor's); it is fixed, so a repeat is
bit-identical. Used only inside ``fused_kernels()`` on CUDA for at most :data:`MAX_ROWS` rows (a
decode step) when no gradient is wanted (the kernel has no backward; an RL update's forward runs
inside ``fused_kernels`` too); ``HOBSON_ROW_NORMS=0`` leaves those to the compiled chains.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from hobson.models.triton_env import triton_available

MAX_ROWS = 64  # a decode step's batch; a prefill's thousands of rows stay with inductor's kernels
MAX_N = 16384  # one row in one program's registers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

tl = None  # triton.language, imported with the kernel (a module global: Triton's interpreter patches those)


def enabled() -> bool:
    return os.environ.get("HOBSON_ROW_NORMS", "1") != "0"


def usable(a: Tensor, b: Tensor, *weights: Tensor) -> bool:
    """Whether the kernel takes this call: CUDA (or Triton's interpreter), no gradient wanted, rows
    of one dtype with their last dimension contiguous, at most :data:`MAX_ROWS` rows of at most
    :data:`MAX_N`, and weights of that width and dtype."""
    if not (enabled() and triton_available()) or not (a.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, *weights)):
        return False
    n = a.shape[-1]
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in _DTYPES or n > MAX_N or a.numel() == 0:
        return False
    if a.numel() // n > MAX_ROWS or a.stride(-1) != 1 or b.stride(-1) != 1:
        return False
    return all(w.shape == (n,) and w.dtype == a.dtype and w.stride(0) == 1 for w in weights)


@functools.cache
def _kernel():  # noqa: ANN202 - a triton JIT function
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def add_norms(A, B, W1, W2, O1, O2, sa, sb, s1, s2, N, eps, BLOCK: tl.constexpr, SANDWICH: tl.constexpr):
        r = tl.program_id(0)
        n = tl.arange(0, BLOCK)
        m = n < N
        a = tl.load(A + r * sa + n, mask=m, other=0.0)
        b = tl.load(B + r * sb + n, mask=m, other=0.0)
        dt = a.dtype
        s = (a.to(tl.float32) + b.to(tl.float32)).to(dt).to(tl.float32)  # a + b, rounded as eager's add
        w1 = tl.load(W1 + n, mask=m, other=0.0).to(tl.float32)
        y = (s * tl.math.rsqrt(tl.sum(s * s, axis=0) / N + eps)).to(dt).to(tl.float32)
        y = (y * w1).to(dt)
        if SANDWICH:  # (norm_1(a + b), norm_2 of that)
            w2 = tl.load(W2 + n, mask=m, other=0.0).to(tl.float32)
            yf = y.to(tl.float32)
            h = (yf * tl.math.rsqrt(tl.sum(yf * yf, axis=0) / N + eps)).to(dt).to(tl.float32)
            tl.store(O1 + r * s1 + n, y, mask=m)
            tl.store(O2 + r * s2 + n, (h * w2).to(dt), mask=m)
        else:  # (a + b, norm_1 of it)
            tl.store(O1 + r * s1 + n, s.to(dt), mask=m)
            tl.store(O2 + r * s2 + n, y, mask=m)

    return add_norms


def _launch(a: Tensor, b: Tensor, w1: Tensor, w2: Tensor, eps: float, sandwich: bool) -> tuple[Tensor, Tensor]:
    n = a.shape[-1]
    a2, b2 = a.reshape(-1, n), b.reshape(-1, n)  # views for the contiguous rows a decode step has
    o1, o2 = torch.empty_like(a2), torch.empty_like(a2)
    block = max(16, 1 << (n - 1).bit_length())
    _kernel()[(a2.shape[0],)](a2, b2, w1, w2, o1, o2, a2.stride(0), b2.stride(0), o1.stride(0), o2.stride(0),
                              n, eps, BLOCK=block, SANDWICH=sandwich, num_warps=8 if block >= 4096 else 4)
    return o1.view(a.shape), o2.view(a.shape)


def add_norm(a: Tensor, b: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(a + b, rms_norm(a + b, w))``."""
    return _launch(a, b, w, w, eps, sandwich=False)


def sandwich(a: Tensor, b: Tensor, w1: Tensor, w2: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, rms_norm(y, w2))`` with ``y = rms_norm(a + b, w1)``."""
    return _launch(a, b, w1, w2, eps, sandwich=True)
