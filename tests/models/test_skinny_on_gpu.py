"""The decode GEMM kernel (hobson.models.skinny) on a GPU: right on any shape, the same bits on
every call, and used only where the rollout engine asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hobson.models.common import Linear, fused_kernels, linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

skinny = pytest.importorskip("hobson.models.skinny")
pytest.importorskip("triton")

# relative Frobenius error against float64: fp32 keeps fp32's accuracy (3xTF32, not TF32's ~1e-3);
# 16-bit outputs are rounded once, as cuBLAS rounds them
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "n", "k"), [(16, 8192, 3072), (16, 3072, 10752), (5, 15840, 5280), (1, 5280, 10560),
                                           (16, 200, 96), (3, 1, 64)])
def test_skinny_equals_a_float64_product_and_repeats_its_bits(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k ** -0.5
    # the engine runs the kernel on fp32 only (16-bit stays with cuBLAS); the kernel takes any of them
    p = skinny.tile_plan(n, k, dtype, torch.cuda.get_device_properties(0).multi_processor_count)
    assert (skinny.plan(n, k, dtype, 132) is not None) == (dtype == torch.float32)
    y = skinny.linear(x, w, p)
    ref = x.double() @ w.double().T
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert float((y.double() - ref).norm() / ref.norm()) < BOUND[dtype]
    assert torch.equal(y, skinny.linear(x, w, p))  # split-K sums in a fixed order: no atomics


def test_skinny_runs_only_inside_the_engines_context_and_for_few_fp32_rows() -> None:
    lin = Linear(3072, 1024, bias=False).cuda()
    torch.nn.init.normal_(lin.weight, std=0.02)
    few = torch.randn(16, 1, 3072, device="cuda")
    many = torch.randn(17, 3072, device="cuda")
    assert not skinny.usable(few.bfloat16(), lin.weight.bfloat16())  # 16-bit: cuBLAS
    # training and prefill: exactly torch's product
    assert torch.equal(lin(few), torch.nn.functional.linear(few, lin.weight))
    with fused_kernels(True):
        assert skinny.usable(few, lin.weight) and not skinny.usable(many, lin.weight)
        assert torch.equal(lin(many), torch.nn.functional.linear(many, lin.weight))
        out = lin(few)
        assert torch.equal(out, skinny.linear(few, lin.weight))
        assert torch.equal(linear(few, lin.weight), out)
    assert out.shape == (16, 1, 1024)
    assert not skinny.usable(few.cpu(), lin.weight.cpu())


ROUTES = ["cublas", "cublaslt", "cublas swapped", "cublaslt swapped", "triton", "triton 128x128 s2 st3"]


@pytest.mark.parametrize("r", ROUTES)
def test_a_16_bit_route_is_right_repeats_its_bits_and_runs_only_in_the_engine(
        r: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 3072, 6144  # Nanbeige's o projection
    table = tmp_path / "routes.json"
    table.write_text(f'[{{"n": {n}, "k": {k}, "dtype": "bfloat16", "route": "{r}"}}]')
    monkeypatch.setenv("HOBSON_GEMM16_ROUTES", str(table))
    skinny._routes.cache_clear()
    try:
        g = torch.Generator(device="cuda").manual_seed(7)
        x = torch.randn(16, 1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        assert skinny.route(x, w) == (None if r == "cublas" else r)
        assert skinny.route(x.float(), w.float()) is None  # fp32 has its own plan
        assert skinny.route(torch.cat([x] * 2), w) is None  # 32 rows: a prefill's product
        assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))  # outside the engine: torch
        with fused_kernels(True):
            y = linear(x, w)
            assert torch.equal(y, linear(x, w))
        assert y.shape == (16, 1, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
        ref = x.double() @ w.double().T
        assert float((y.double() - ref).norm() / ref.norm()) < BOUND[torch.bfloat16]
    finally:
        skinny._routes.cache_clear()


def test_the_route_table_of_this_card_and_no_other_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOBSON_GEMM16_ROUTES", raising=False)
    x = torch.randn(16, 1, 6144, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 6144, device="cuda", dtype=torch.bfloat16)
    for card, want in ((skinny._card(x.device), "cublaslt"), ("a card not this one", None)):
        monkeypatch.setattr(skinny, "ROUTES_16BIT", {card: {(3072, 6144, "bfloat16"): "cublaslt"}})
        skinny._routes.cache_clear()
        try:
            assert skinny.route(x, w) == want
        finally:
            skinny._routes.cache_clear()
