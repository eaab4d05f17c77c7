"""The decode product with the SwiGLU in its epilogue (``skinny.linear_glu``) under Triton's
interpreter, against ``silu(gate) * up`` of a float64 product rounded as the separate kernels round it.

Like tests/models/test_decode_attention.py: the interpreter needs the triton package only, which
CPU torch does not bring and CI does not install, so there these tests skip; each check runs in a
fresh process (``TRITON_INTERPRET=1`` must be set before triton is first imported). fp16 here (the
interpreter has no bf16 dot); tests/models/test_skinny_on_gpu.py runs it compiled in bf16 and fp16.
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
    r = subprocess.run([sys.executable, "-m", "tests.models.test_skinny_glu", json.dumps(case)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def check(case: dict) -> dict:
    """``linear_glu`` on random rows: its largest difference from the rounded float64 reference (in
    units of the output's rounding step), whether a repeat gives the same bits, and the shape."""
    from hobson.models import skinny

    m, i, k = case["m"], case["i"], case["k"]
    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(m * 1000 + i + k)
    x = torch.randn(m, 1, k, generator=g).to(dtype)
    w = (torch.randn(2 * i, k, generator=g) * k ** -0.5).to(dtype)
    p = skinny.Plan(*case["plan"])
    y = skinny.linear_glu(x, w, p)
    gate, up = (x.double() @ w.double().T).to(dtype).double().chunk(2, dim=-1)  # each half rounded, as the kernels
    ref = torch.nn.functional.silu(gate) * up
    step = ref.abs().clamp_min(torch.finfo(dtype).tiny) * torch.finfo(dtype).eps  # one rounding step near each value
    return {"shape": list(y.shape), "dtype": str(y.dtype), "ulps": float(((y.double() - ref).abs() / step).max()),
            "repeat_equal": torch.equal(y, skinny.linear_glu(x, w, p))}


@pytest.mark.parametrize(("m", "i", "k", "plan"), [
    (16, 64, 256, (64, 64, 1, 4, 2)),   # whole tiles, the SwiGLU in the product's epilogue
    (5, 96, 320, (64, 64, 2, 4, 2)),    # K split in two: the sum-of-splits kernel applies it
    (3, 40, 200, (32, 64, 3, 4, 2)),    # ragged outputs and K, three splits asked, two whole tiles of K each
    (1, 24, 64, (128, 64, 1, 4, 2)),    # one row, a tile wider than the outputs
])
def test_interpreted_glu_product_is_silu_gate_times_up_rounded_once(m: int, i: int, k: int, plan: tuple) -> None:
    res = _interpreted({"m": m, "i": i, "k": k, "plan": list(plan), "dtype": "float16"})
    assert res["shape"] == [m, 1, i] and res["dtype"] == "torch.float16", res
    # the product's fp32 sum rounds each half like the reference's float64 one except near a tie,
    # then one rounding of the SwiGLU: within two rounding steps of the output
    assert res["ulps"] <= 2.0, res
    assert res["repeat_equal"], res


if __name__ == "__main__":
    from tests.models.test_decode_attention import _interpreter_takes_numpy_2

    _interpreter_takes_numpy_2()
    print(json.dumps(check(json.loads(sys.argv[1]))))
