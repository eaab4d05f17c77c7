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


def test_forward_seconds_add_up_the_model_calls(teacher, corpus_rows, tmp_path):
    """``forward_seconds`` grows by each batch's model part and covers every forward's own time."""
    import time

    from hobson.labels import label_rows
    from hobson.labels.lm_scorer import LMOptionScorer

    _, model, tokenizer = teacher
    spent: list[float] = []

    class Slow(torch.nn.Module):  # the model, 20 ms slower per call: a floor the clock must see
        def forward(self, **kwargs):
            start = time.perf_counter()
            time.sleep(0.02)
            out = model(**kwargs)
            spent.append(time.perf_counter() - start)
            return out

    scorer = LMOptionScorer(Slow(), tokenizer)
    assert scorer.forward_seconds == 0.0
    start = time.perf_counter()
    label_rows(corpus_rows[:6], scorer, out=str(tmp_path / "l.jsonl"), max_batch_tokens=10**6,
               max_batch_rows=2)
    wall = time.perf_counter() - start
    assert len(spent) == 3  # 6 rows, 2 per batch
    assert sum(spent) <= scorer.forward_seconds <= wall

