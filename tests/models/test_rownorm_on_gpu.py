"""The row-norm kernel (hobson.models.rownorm) compiled on a GPU, at the official widths, against
the eager chains it replaces in a decode step; the interpreter's checks are in test_rownorm.py."""

from __future__ import annotations

import pytest
import torch

from hobson.models import common
from hobson.models.huginn import _sandwich_norms, sandwich_norms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("triton")
rownorm = pytest.importorskip("hobson.models.rownorm")


def _steps(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference in rounding steps of the dtype, relative to each row's largest value."""
    d = (x.float() - ref.float()).abs() / ref.float().abs().amax(-1, keepdim=True)
    return float(d.max() / torch.finfo(x.dtype).eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "n"), [(16, 5280), (16, 3072), (1, 5280), (7, 96)])
def test_kernel_is_the_eager_chain_at_the_official_widths(dtype: torch.dtype, rows: int, n: int) -> None:
    """Huginn's 5,280 and Nanbeige's 3,072 at a decode step's 16 rows (and 1, and a small odd
    case): the residual sum bit-equal to eager's add; each norm within one rounding step of eager's
    for 16 bits (two for the sandwich's second norm, whose input may already differ by one; four
    for fp32, whose sum of squares runs in another order), most values bit-equal (the kernel rounds
    where eager rounds), and a repeat bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(n + rows)
    a = (torch.randn(rows, 1, n, device="cuda", generator=g) * 3).to(dtype)
    b = torch.randn(rows, 1, n, device="cuda", generator=g).to(dtype)
    w1 = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
    w2 = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
    eps = 1e-6
    assert rownorm.usable(a, b, w1, w2)
    s, y = rownorm.add_norm(a, b, w1, eps)
    s0, y0 = common._add_rms_norm.__wrapped__(a, b, w1, eps)
    y1, h1 = rownorm.sandwich(a, b, w1, w2, eps)
    y2, h2 = _sandwich_norms.__wrapped__(a, b, w1, w2, eps)
    assert torch.equal(s, s0)
    one = 4.0 if dtype == torch.float32 else 1.0
    assert _steps(y, y0) <= one and _steps(y1, y2) <= one and _steps(h1, h2) <= 2 * one
    if dtype != torch.float32:
        assert (y == y0).float().mean() > 0.9 and (h1 == h2).float().mean() > 0.9
    assert torch.equal(y, rownorm.add_norm(a, b, w1, eps)[1])
    assert torch.equal(h1, rownorm.sandwich(a, b, w1, w2, eps)[1])


def test_only_the_engines_few_rows_take_the_kernel() -> None:
    """Inside ``fused_kernels`` a decode step's rows run the kernel; a prefill's many rows and every
    call outside the engine (training) run as before."""
    n = 5280
    few = torch.randn(16, 1, n, device="cuda", dtype=torch.bfloat16)
    many = torch.randn(2048, n, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    assert not rownorm.usable(many, many, w, w)
    outside = sandwich_norms(few, few, w, w, 1e-6)
    eager = _sandwich_norms.__wrapped__(few, few, w, w, 1e-6)
    assert all(torch.equal(o, e) for o, e in zip(outside, eager, strict=True))
    with common.fused_kernels(True):
        inside = sandwich_norms(few, few, w, w, 1e-6)
    assert all(torch.equal(o, k) for o, k in zip(inside, rownorm.sandwich(few, few, w, w, 1e-6), strict=True))


def test_a_forward_that_wants_gradients_keeps_them_inside_fused_kernels() -> None:
    """An RL update's forward runs inside ``fused_kernels`` too; at 16 rows (a tiny batch) its norms
    and products would fit the decode kernels, which have no backward. They stay with torch: every
    weight gets the gradient it gets outside ``fused_kernels`` (up to the compiled chains' rounding)."""
    from hobson.models.huginn import HuginnRaven, tiny_config

    torch.manual_seed(0)
    model = HuginnRaven(tiny_config())
    model.init_weights(0)  # a bare module's parameters are uninitialised memory: NaN gradients on CPU
    model = model.cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), device="cuda")

    def grads(fused: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with common.fused_kernels(on=fused, dynamic=True):
            model(ids, num_steps_no_grad=1, num_steps_with_grad=2).logsumexp(-1).mean().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    eager, inside = grads(False), grads(True)
    assert eager.keys() == inside.keys() and len(eager) > 10
    for k in eager:
        assert eager[k].isfinite().all(), k
        torch.testing.assert_close(inside[k], eager[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
