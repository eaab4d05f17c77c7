"""The labeller's forwards run with cuDNN's SDPA off: its per-shape graphs cost more than the
forward when every length-packed batch has a new shape (profiled on an H200)."""

from __future__ import annotations

import torch


def test_scoring_forward_has_cudnn_sdpa_off(teacher, corpus_rows, monkeypatch):
    from hobson.labels.lm_scorer import LMOptionScorer

    _, model, tokenizer = teacher
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    probs = LMOptionScorer(model, tokenizer).score_batch(corpus_rows[:3])
    assert len(probs) == 3 and all(abs(sum(p) - 1) < 1e-5 for p in probs)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process-wide flag is put back
