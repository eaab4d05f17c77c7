"""The row-norm kernel (hobson.models.rownorm) in Triton's interpreter, against the eager chains it
replaces in a decode step (``add_rms_norm``: Nanbeige's residual add and norm; ``sandwich_norms``:
Huginn's two norms after a block).

CPU torch does not bring triton and CI does not install it (see test_decode_attention.py), so
there these tests skip; after ``pip install triton`` a CPU host runs them. The interpreter is
chosen before triton's first import, so each check runs in a fresh process. bf16 is checked on the
GPU only (tests/models/test_rownorm_on_gpu.py): the interpreter casts fp32 to bf16 by truncation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the kernel is Triton; CPU torch does not bring it (pip install triton)")


def _interpreted(case: dict) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "tests.models.test_rownorm", json.dumps(case)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def check(case: dict) -> dict:
    """Both chains on ``case``'s rows through the kernel and eagerly: the largest difference of
    each output in rounding steps of its dtype (relative to the row's largest value), whether the
    residual sum is bit-equal, whether a repeat is, and whether the engine's front doors took the
    kernel inside ``fused_kernels`` (and only there)."""
    from hobson.models import common, rownorm
    from hobson.models.huginn import _sandwich_norms, sandwich_norms

    dtype = getattr(torch, case["dtype"])
    eps = torch.finfo(torch.float32).eps if case.get("eps") is None else case["eps"]
    g = torch.Generator().manual_seed(case["n"])
    shape = (case["rows"], 1, case["n"])
    a = (torch.randn(shape, generator=g) * 3).to(dtype)
    b = torch.randn(shape, generator=g).to(dtype)
    w1 = (1 + 0.1 * torch.randn(case["n"], generator=g)).to(dtype)
    w2 = (1 + 0.1 * torch.randn(case["n"], generator=g)).to(dtype)
    step = torch.finfo(dtype).eps

    def steps(x: torch.Tensor, ref: torch.Tensor) -> float:
        return float(((x.float() - ref.float()).abs() / ref.float().abs().amax(-1, keepdim=True)).max() / step)

    out: dict = {"usable": rownorm.usable(a, b, w1, w2)}
    s, y = rownorm.add_norm(a, b, w1, eps)
    s0, y0 = common._add_rms_norm.__wrapped__(a, b, w1, eps)
    y1, h1 = rownorm.sandwich(a, b, w1, w2, eps)
    y2, h2 = _sandwich_norms.__wrapped__(a, b, w1, w2, eps)
    out["sum_equal"] = torch.equal(s, s0)
    out["norm_steps"] = steps(y, y0)
    out["sandwich_steps"] = max(steps(y1, y2), steps(h1, h2))
    out["shapes"] = all(t.shape == shape and t.dtype == dtype for t in (s, y, y1, h1))
    out["repeat_equal"] = torch.equal(y, rownorm.add_norm(a, b, w1, eps)[1]) and torch.equal(
        h1, rownorm.sandwich(a, b, w1, w2, eps)[1])
    with common.fused_kernels(True):
        took = torch.equal(common.add_rms_norm(a, b, w1, eps)[1], y) and torch.equal(
            sandwich_norms(a, b, w1, w2, eps)[1], h1)
    outside = torch.equal(sandwich_norms(a, b, w1, w2, eps)[1], h2)  # outside the engine: eager, unchanged
    out["front_doors"] = took and outside
    # a forward whose gradient is wanted (an RL update's, inside fused_kernels too) stays with the
    # compiled chain, which has a backward: the kernel has none
    wg = w1.clone().requires_grad_(True)
    with common.fused_kernels(True):
        y_grad = sandwich_norms(a, b, wg, w2, eps)[1]
    out["grad_kept"] = y_grad.requires_grad and not rownorm.usable(a, b, wg, w2)
    return out


@pytest.mark.parametrize(("rows", "n", "dtype"), [(16, 5280, "float32"), (3, 96, "float32"), (5, 2560, "float16"),
                                                  (16, 5280, "float16"), (1, 100, "float32")])
def test_interpreted_kernel_is_the_eager_chain(rows: int, n: int, dtype: str) -> None:
    """Huginn's width (5,280: a 8,192 block, masked), Nanbeige's (2,560), small and odd widths, one
    row and sixteen: the residual sum bit-equal to eager's add, each norm within one rounding step
    of eager's for 16 bits, four for fp32 (the fp32 sum of squares runs in another order), a repeat bit for bit, and the
    layers' front doors (``add_rms_norm``, ``sandwich_norms``) taking the kernel inside the engine's
    ``fused_kernels`` only, and never for a forward whose gradient is wanted."""
    res = _interpreted({"rows": rows, "n": n, "dtype": dtype})
    assert res["usable"] and res["shapes"] and res["sum_equal"] and res["repeat_equal"], res
    bound = 4.0 if dtype == "float32" else 1.0  # fp32: the sum's order and rsqrt move a few ulps
    assert res["norm_steps"] <= bound and res["sandwich_steps"] <= bound, res
    assert res["front_doors"] and res["grad_kept"], res


def test_usable_only_for_a_decode_steps_rows() -> None:
    """The kernel is for a decode step's few contiguous rows of one dtype; a prefill's thousands of
    rows, a row wider than one program holds, mixed dtypes or a strided row stay with the compiled
    chain. (CPU tensors outside the interpreter are never taken.)"""
    from hobson.models import rownorm

    x = torch.zeros(16, 1, 64)
    w = torch.ones(64)
    assert not rownorm.usable(x, x, w)  # CPU, no interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        assert rownorm.usable(x, x, w)
        assert not rownorm.usable(torch.zeros(rownorm.MAX_ROWS + 1, 64), torch.zeros(rownorm.MAX_ROWS + 1, 64), w)
        wide = torch.zeros(2, rownorm.MAX_N + 1)
        assert not rownorm.usable(wide, wide, torch.ones(rownorm.MAX_N + 1))
        assert not rownorm.usable(x, x.half(), w) and not rownorm.usable(x, x, w.half())
        strided = torch.zeros(16, 128)[:, ::2]
        assert not rownorm.usable(strided, strided, w)
    finally:
        del os.environ["TRITON_INTERPRET"]


if __name__ == "__main__":
    print(json.dumps(check(json.loads(sys.argv[1]))))
