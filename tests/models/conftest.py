"""Helpers for the model tests: the committed official-name fixtures and tiny checkpoints built from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "official-models"
HUGINN = "huginn-0125"
NANBEIGE = "nanbeige4.2-3b"

# Official dimension -> tiny dimension, per checkpoint (1 and 2 stay). Derived by hand from the
# configs: Huginn E 5280, 3E 15840, 2E 10560, I 17920, 2I 35840, H 55, D 96, D/2 48, V 65536,
# block 4096; Nanbeige hidden 3072, H·D 6144, Hkv·D 1024, I 10752, V 166144.
TINY_DIMS = {
    HUGINN: {5280: 64, 15840: 192, 10560: 128, 17920: 96, 35840: 192, 55: 4, 96: 16, 48: 8, 65536: 256, 4096: 64},
    NANBEIGE: {3072: 64, 6144: 128, 1024: 64, 10752: 96, 166144: 256},
}
TINY_CONFIG = {
    HUGINN: dict(
        n_embd=64,
        n_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=96,
        vocab_size=256,
        padded_vocab_size=256,
        block_size=64,
        mean_recurrence=2,
    ),
    NANBEIGE: dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        kv_channels=32,
        intermediate_size=96,
        vocab_size=256,
    ),
}
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models on a shared 2-core machine run 10-50x faster on one thread (no spin-waiting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def read_params(name: str) -> dict[str, tuple[list[int], str]]:
    """``{tensor name: (shape, safetensors dtype)}`` from a committed params.tsv."""
    out = {}
    for line in (FIXTURES / f"{name}.params.tsv").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        tname, shape, dtype = line.split("\t")
        out[tname] = (json.loads(shape), dtype)
    return out


def read_fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.config.json").read_text())


def tiny_official_checkpoint(name: str, out: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a checkpoint with the official names (from params.tsv) at tiny shapes, as two shards
    plus an index like the real one; returns the tensors written."""
    from hobson.models.huginn import rope_table

    g = torch.Generator().manual_seed(seed)
    dims = TINY_DIMS[name]
    tensors = {}
    for tname, (shape, dtype) in read_params(name).items():
        tiny = [dims.get(d, d) for d in shape]
        tensors[tname] = (torch.randn(tiny, generator=g) * 0.05).to(DTYPES[dtype])
    if name == HUGINN:
        tensors["freqs_cis"] = rope_table(16, 64, 50000.0)
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    out.mkdir(parents=True)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, shard in shards.items():
        save_file({n: tensors[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, s in shards.items() for n in s}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = read_fixture_config(name)
    config.update(TINY_CONFIG[name])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


@pytest.fixture
def huginn_ckpt(tmp_path):
    tensors = tiny_official_checkpoint(HUGINN, tmp_path / "huginn")
    return tmp_path / "huginn", tensors


@pytest.fixture
def nanbeige_ckpt(tmp_path):
    tensors = tiny_official_checkpoint(NANBEIGE, tmp_path / "nanbeige")
    return tmp_path / "nanbeige", tensors
