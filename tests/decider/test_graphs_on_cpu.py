"""What the CUDA-graph path of the decider step rests on, checked on a CPU: a micro-batch padded to
its bucket trains the same rows (its pad rows add exactly nothing to the loss or any gradient),
and the settings that cannot run as graphs are refused with one clear error."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from hobson.decider.collate import Collator, to_canonical
from hobson.decider.config import load_train_config
from hobson.decider.graphs import pad_batch, round_up
from hobson.decider.loss import decider_loss
from hobson.decider.model import build_decider
from hobson.decider.train import DeciderTrainRecipe
from hobson.errors import ConfigError
from hobson.io import read_jsonl


def _loss(model, batch, cfg, rows=slice(None)):
    out = model(batch)

    def pick(x):
        return x[rows]

    loss, metrics = decider_loss(
        pick(to_canonical(out["logits"], batch.perm)), pick(batch.option_mask), pick(batch.label),
        pick(batch.is_score), pick(batch.weight), pick(batch.teacher), pick(batch.has_teacher),
        pick(to_canonical(out["frozen_logits"], batch.perm)), score_eps=cfg.score_smoothing,
        kl_teacher_weight=cfg.kl_teacher_weight, kl_frozen_weight=cfg.kl_frozen_weight,
        kl_direction=cfg.kl_direction)
    return loss, metrics


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_pad_rows_add_exactly_nothing_and_real_rows_train_the_same(decider_data, config_factory, tmp_path,
                                                                      direction):
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out", kl_direction=direction))
    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    model = build_decider(cfg, tok, "cpu").train()
    params = model.trainable_parameters()
    rows = read_jsonl(decider_data["train"])[:5]
    teacher = {0: [1 / len(rows[0]["options"])] * len(rows[0]["options"])}  # row 0 has a teacher, the rest not
    collator = Collator(tok, max_length=cfg.max_length, force_bos=False, seed=0, teacher=teacher)
    batch = collator.collate(list(enumerate(rows)))
    B, T = batch.input_ids.shape
    N = batch.option_pos.shape[1]
    padded = pad_batch(batch, rows=B + 3, length=round_up(T + 1, 32), options=round_up(N, 8),
                       pad_id=collator.pad_id)
    assert padded.input_ids.shape == (B + 3, round_up(T + 1, 32)) and padded.option_pos.shape[1] == 8
    assert torch.equal(padded.input_ids[:B, :T], batch.input_ids) and padded.row_index == batch.row_index

    # the pad rows alone: loss exactly 0, every gradient exactly 0, none counted correct
    loss, metrics = _loss(model, padded, cfg, rows=slice(B, None))
    loss.backward()
    assert loss.item() == 0.0 and metrics["correct"].item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in params)
    model.zero_grad(set_to_none=True)

    # the real rows: the same loss and gradients as unpadded, to fp32 rounding (longer GEMMs)
    loss_plain, m_plain = _loss(model, batch, cfg)
    loss_plain.backward()
    grads_plain = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    loss_pad, m_pad = _loss(model, padded, cfg)
    loss_pad.backward()
    torch.testing.assert_close(loss_pad, loss_plain, rtol=1e-5, atol=1e-6)
    for k in ("ce", "kl_teacher", "kl_frozen", "correct"):
        torch.testing.assert_close(m_pad[k], m_plain[k], rtol=1e-5, atol=1e-6)
    assert m_pad["rows"].item() == B + 3  # the trainer takes the pad rows back off this count
    for p, g in zip(params, grads_plain, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_pad_batch_refuses_a_batch_larger_than_its_bucket(decider_data):
    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    rows = read_jsonl(decider_data["train"])[:4]
    batch = Collator(tok, max_length=128, force_bos=False, seed=0).collate(list(enumerate(rows)))
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(batch, rows=3, length=256, options=8, pad_id=0)


def test_cuda_graphs_settings_that_cannot_run_are_refused(config_factory, tmp_path):
    with pytest.raises(ConfigError, match="lora_dropout: 0"):
        load_train_config(config_factory(tmp_path / "a.yaml", tmp_path / "a", cuda_graphs=True, lora_dropout=0.1))
    with pytest.raises(ConfigError, match="cannot capture attn_implementation: eager"):
        load_train_config(config_factory(tmp_path / "e.yaml", tmp_path / "e", cuda_graphs=True,
                                         attn_implementation="eager"))
    with pytest.raises(ConfigError, match=r"b.yaml:\d+: 'graph_length_multiple' must be >= 1, got 0"):
        load_train_config(config_factory(tmp_path / "b.yaml", tmp_path / "b", graph_length_multiple=0))
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "c", cuda_graphs=True, device="cpu"))
    with pytest.raises(ConfigError, match="cuda_graphs: true replays CUDA graphs, but this run trains on cpu"):
        DeciderTrainRecipe(cfg)
