"""A decider training micro-batch on a GPU never makes the host wait for the device: the copy in,
the forward, the frozen forward, the loss and the backward run under CUDA's sync debug mode set to
raise (the CPU census in test_masks_on_cpu.py shows the reads are gone; this shows the copies and
everything the CPU cannot see, such as a copy from pageable memory, are too)."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch
from transformers import AutoTokenizer

from hobson.decider.collate import Collator
from hobson.decider.config import load_train_config
from hobson.decider.model import build_decider
from hobson.io import read_jsonl
from tests.decider.conftest import micro_batch_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("bf16", [False, True])
def test_a_micro_batch_runs_without_a_device_sync(decider_data, config_factory, tmp_path, bf16):
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out", device="cuda", bf16=bf16))
    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    model = build_decider(cfg, tok, "cuda").train()
    rows = read_jsonl(decider_data["train"])[:6]
    collator = Collator(tok, max_length=1024, force_bos=False, seed=0)
    warm = collator.collate(list(enumerate(rows))).to("cuda")  # first calls: allocator, cuBLAS handles
    model(warm)["logits"].sum().backward()
    batch = collator.collate(list(enumerate(rows)))
    assert len({len(ids) for ids in batch.token_ids}) > 1  # padded: the masks are built
    torch.cuda.synchronize()
    # "warn", not "error": every waiting line is named in one run, with the project's frames
    # above it (the innermost Python frame is often torch's own)
    waits: set[str] = set()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            frames = [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                      if "hobson" in f.filename or "/tests/" in f.filename or f.filename == filename]
            waits.add(" < ".join(reversed(frames[-4:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            batch = batch.to("cuda")
            loss = micro_batch_loss(model, batch, cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not waits, sorted(waits)
    assert torch.isfinite(loss).item()
