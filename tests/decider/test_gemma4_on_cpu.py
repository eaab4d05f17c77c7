"""A tiny Gemma 4 (multimodal wrapper: text decoder + vision and audio encoders) as the torso.

Skipped where the installed transformers has no Gemma 4 classes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.gemma4")

from hobson.decider.collate import Collator  # noqa: E402
from hobson.decider.config import TrainConfig  # noqa: E402
from hobson.decider.model import build_decider  # noqa: E402


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory, decider_data):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.gemma4 import Gemma4Config

    tok = AutoTokenizer.from_pretrained(decider_data["torso"])  # the tests' 300-token BPE
    V = len(tok)
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                layer_types=["sliding_attention", "full_attention"], sliding_window=64, vocab_size_per_layer_input=V,
                hidden_size_per_layer_input=8, final_logit_softcapping=3.0, initializer_range=0.5,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    audio = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=16)
    special = {k: V - 1 for k in ("boi_token_id", "eoi_token_id", "image_token_id", "video_token_id",
                                   "boa_token_id", "eoa_token_index", "audio_token_id")}
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, **special)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gemma4")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_gemma4_keeps_the_text_decoder_and_soft_caps_the_frozen_readout(gemma4_dir, decider_data, tmp_path):
    from hobson.io import read_jsonl

    cfg = TrainConfig(base_model=str(gemma4_dir), train_files=[str(decider_data["train"])], output_dir=str(tmp_path),
                      pointer_dim=8, lora_r=2, lora_alpha=4, lora_targets=["q_proj", "v_proj"], kl_frozen_weight=0.1,
                      attn_implementation="eager", max_length=128, host_embeddings=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma4_dir)
    model = build_decider(cfg, tok)
    names = [n for n, _ in model.torso.named_modules()]
    assert not any("vision" in n or "audio" in n for n in names)
    assert any(n.endswith("embed_tokens_per_layer") for n in names)
    assert model.adapter_state() and all("language_model" not in k or "vision" not in k for k in model.adapter_state())
    assert model.softcap == 3.0
    rows = read_jsonl(decider_data["train"])[:4]
    batch = Collator(tok, max_length=128, force_bos=False, seed=0, shuffle=False).collate(list(enumerate(rows)))
    out = model(batch)
    assert out["logits"].shape == batch.option_mask.shape
    frozen = out["frozen_logits"]
    assert frozen.abs().max() < 3.0  # tanh soft-cap at 3 ...
    model.softcap = None
    raw = model.frozen_logits(batch)
    assert raw.abs().max() > 3.0  # ... of letter logits that are larger
    assert torch.allclose(frozen, torch.tanh(raw / 3.0) * 3.0, atol=1e-5)
    out["logits"].sum().backward()  # LoRA and head train through the Gemma 4 decoder
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n)
