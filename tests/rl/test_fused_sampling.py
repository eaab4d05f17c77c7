"""A graphed decode step's sampling and bookkeeping, compiled (as inside the engine's fused kernels
on CUDA), leave the same bits in the step's buffers as the eager operations (CPU, inductor's C++)."""

from __future__ import annotations

import pytest
import torch

from hobson.models.common import fused_kernels
from hobson.rollout import engine


def _buffers(B: int, N: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"tok": torch.randint(0, 50, (B,), generator=g), "step_at": torch.tensor([3]),
            "next_pos": torch.randint(4, 9, (B, 1), generator=g), "out_tok": torch.randint(0, 50, (B, N), generator=g),
            "out_lp": torch.randn(B, N, generator=g), "n_valid": torch.randint(0, 4, (B,), generator=g),
            "done": torch.tensor([False, True, False, False, True]), "feed": torch.zeros(B, dtype=torch.long),
            "live": torch.zeros(B, 1, dtype=torch.long)}


@pytest.mark.parametrize("advance", [False, True])
def test_compiled_bookkeeping_writes_the_eager_bits(advance: bool) -> None:
    B, N = 5, 8
    new_tok = torch.tensor([7, 2, 9, 2, 11])  # 2 is the EOS below: row 3 finishes, row 1 had
    lp = torch.randn(B, 1, generator=torch.Generator().manual_seed(2))
    runs = []
    for compiled in (False, True):
        bufs = _buffers(B, N)
        with fused_kernels(compiled):
            engine._feed_fused(bufs["tok"], bufs["done"], bufs["feed"], bufs["live"], 0)
            engine._book_fused(new_tok, lp, bufs["tok"], bufs["step_at"], bufs["next_pos"], bufs["out_tok"],
                               bufs["out_lp"], bufs["n_valid"], bufs["done"], 2, advance)
        runs.append(bufs)
    eager, comp = runs
    for name, t in eager.items():
        assert torch.equal(t, comp[name]), name
    at = 4 if advance else 3
    assert eager["out_tok"][:, at].tolist() == new_tok.tolist() and torch.equal(eager["out_lp"][:, at], lp[:, 0])
    assert eager["done"].tolist() == [False, True, False, True, True]
    before = _buffers(B, N)
    assert eager["feed"].tolist() == torch.where(before["done"], 0, before["tok"]).tolist()


def test_compiled_race_picks_the_eager_winners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOBSON_FUSED_SAMPLING", "1")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 1000, generator=g) * 3
    noise = torch.empty(4, 1000).exponential_(generator=g)
    eager = engine._race(logits, noise, 0.7)
    with fused_kernels():
        compiled = engine._race(logits, noise, 0.7)
    assert torch.equal(eager, (torch.softmax(logits / 0.7, dim=-1) / noise).argmax(dim=-1))
    assert torch.equal(compiled, eager)
