"""The decode-attention kernel against the path it replaces (``cache.update`` then ``attend``).

On a CPU the kernel runs in Triton's interpreter, where it needs the triton package only. CPU
torch does not bring it, and CI does not install it (beside CPU torch it breaks the vLLM overlay
of tests/vllm_env.sh), so there these tests skip; a GPU host's torch brings triton, and after
``pip install triton`` a CPU host runs them too (session 25: 4 passed, triton 3.6.0 and 3.9.0).
The interpreter must be chosen before triton is first imported (``TRITON_INTERPRET=1`` then
builds ``triton.language`` for it), so each check runs in a fresh process.
tests/models/test_decode_attention_on_gpu.py runs the kernel compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hobson.models import decode_attention
from tests.models.decode_attention_cases import reference_and_kernel

pytest.importorskip("triton", reason="the kernel is Triton; CPU torch does not bring it (pip install triton)")


def _interpreted(case: dict) -> dict:
    """Run :func:`check` on ``case`` in a fresh process under Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "tests.models.test_decode_attention", json.dumps(case)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def check(case: dict) -> dict:
    """Every position of ``case`` through both paths; the largest difference of the outputs and of
    the cache writes, and whether the cache writes and a repeat are bit-identical."""
    out = {"max_diff": 0.0, "cache_diff": 0.0, "cache_equal": True, "contiguous": True, "repeat_equal": True}
    dtype = getattr(torch, case.get("dtype", "float32"))
    plan = decode_attention.Plan(block=case.get("block", decode_attention.BLOCK), dot=case.get("dot", True),
                                 split=case.get("split", 1))
    kw = {"rope": case.get("rope", False), "plan": plan}
    for pos in case["positions"]:
        args = (3, case["H"], case["hkv"], case["D"], 48, pos, dtype, "cpu")
        (y_ref, k_ref, v_ref), (y, k, v) = reference_and_kernel(*args, seed=pos, **kw)
        assert y.shape == y_ref.shape == (3, case["H"], 1, case["D"])
        rel = (y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()
        out["max_diff"] = max(out["max_diff"], float(rel))
        out["cache_diff"] = max(out["cache_diff"], float((k.float() - k_ref.float()).abs().max()))
        out["cache_equal"] &= torch.equal(k, k_ref) and torch.equal(v, v_ref)
        out["contiguous"] &= y.transpose(1, 2).is_contiguous()
        out["repeat_equal"] &= torch.equal(y, reference_and_kernel(*args, seed=pos, **kw)[1][0])
    return out


@pytest.mark.parametrize(("H", "hkv", "D", "dtype"), [(8, 2, 32, "float32"), (4, 4, 24, "float32"),
                                                      (6, 2, 16, "float32"), (8, 2, 32, "float16")])
def test_interpreted_kernel_matches_update_then_attend(H: int, hkv: int, D: int, dtype: str) -> None:
    """GQA folds (4 and 3 query heads per KV head) and none, a head size below a power of two,
    write positions at and across the kernel's 32-slot blocks (stale keys after them): within
    float rounding (relative to the largest output; fp16 rounds the softmax weights to 16 bits
    before the second product, as flash attention does), the cache holding exactly what
    ``update`` writes, a repeat bit for bit, and the output laid out so the caller's transpose
    back to ``(B, 1, H, D)`` copies nothing. (bf16 runs on the GPU only: the interpreter's bf16
    products are wrong, 2.6e10 off for a 16 × 16 tl.dot in Triton 3.6 and 3.9.)"""
    res = _interpreted({"H": H, "hkv": hkv, "D": D, "dtype": dtype, "positions": [0, 1, 31, 32, 45]})
    assert res["max_diff"] < (1e-5 if dtype == "float32" else 2e-3), res
    assert res["cache_equal"] and res["contiguous"] and res["repeat_equal"], res


@pytest.mark.parametrize(("H", "hkv", "D", "dtype", "dot"), [(8, 2, 32, "float32", True), (3, 3, 24, "float32", False),
                                                             (6, 2, 16, "float32", False), (8, 2, 32, "float16", True)])
def test_interpreted_kernel_with_rope(H: int, hkv: int, D: int, dtype: str, dot: bool) -> None:
    """RoPE inside the kernel (Nanbeige's decode step) against Nanbeige's eager ``apply_rope`` then
    update + attend: outputs within float rounding, the rotated key written to the cache within one
    rounding of the eager one (the kernel rotates in fp32 and rounds once, as the compiled RoPE
    kernel it replaces does; eager rounds each product), in both product forms."""
    res = _interpreted({"H": H, "hkv": hkv, "D": D, "dtype": dtype, "dot": dot, "rope": True,
                        "positions": [0, 1, 31, 32, 45]})
    assert res["max_diff"] < (1e-5 if dtype == "float32" else 2e-3), res
    assert res["cache_diff"] < (1e-5 if dtype == "float32" else 1e-2), res
    assert res["contiguous"] and res["repeat_equal"], res


@pytest.mark.parametrize(("H", "hkv", "D", "block"), [(4, 4, 24, 16), (6, 2, 16, 64), (2, 1, 96, 32)])
def test_interpreted_elementwise_products(H: int, hkv: int, D: int, block: int) -> None:
    """The elementwise form (no ``tl.dot``, no padding of the query heads to 16 rows: the plan for
    one query head per KV head, Huginn's case) and other blocks of cache positions give the same
    results as update + attend, and the cache holds exactly what ``update`` writes."""
    res = _interpreted({"H": H, "hkv": hkv, "D": D, "dot": False, "block": block, "positions": [0, 1, 15, 16, 47]})
    assert res["max_diff"] < 1e-5, res
    assert res["cache_equal"] and res["contiguous"] and res["repeat_equal"], res


@pytest.mark.parametrize(("H", "hkv", "D", "dtype", "dot", "rope"), [
    (2, 1, 96, "float32", True, False), (3, 3, 24, "float32", False, False),
    (8, 2, 32, "float16", True, True), (6, 2, 16, "float32", False, True)])
def test_interpreted_split_over_the_cache(H: int, hkv: int, D: int, dtype: str, dot: bool, rope: bool) -> None:
    """The cache split over 3 programs per KV head (16-position chunks of the 48-slot cache) and
    combined: write positions in the first chunk, at and across chunk bounds and in the last
    (chunks past the write position, and chunks whose keys the mask removes, weigh nothing), in
    both product forms, with and without RoPE: within float rounding of update + attend, the cache
    holding what ``update`` writes (written once, by the first chunk's program), bits repeated."""
    res = _interpreted({"H": H, "hkv": hkv, "D": D, "dtype": dtype, "dot": dot, "rope": rope, "split": 3,
                        "block": 16, "positions": [0, 5, 16, 17, 32, 47]})
    assert res["max_diff"] < (1e-5 if dtype == "float32" else 2e-3), res
    if not rope:
        assert res["cache_equal"], res
    assert res["cache_diff"] < (1e-5 if dtype == "float32" else 1e-2), res
    assert res["contiguous"] and res["repeat_equal"], res


def _interpreter_takes_numpy_2() -> None:
    """Triton 3.6's interpreter turns a scalar into Python's int with ``int(array)``, which NumPy
    2.4 refuses for its one-element arrays (a loaded scalar as a ``range`` bound then fails; 3.9
    squeezes first); the compiled kernel has no such step. Patched here, in the check's process only."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    _interpreter_takes_numpy_2()
    print(json.dumps(check(json.loads(sys.argv[1]))))
