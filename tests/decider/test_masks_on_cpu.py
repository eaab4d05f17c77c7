"""The decider builds each layer type's attention mask from the host's knowledge of the padding
(hobson.attention.mask_mapping): the torso's outputs are those of its own mask building, bit for
bit, and a training micro-batch reads nothing back from the device (on a GPU, each read is a sync
that stops the host from running ahead of the kernels)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5TextConfig, Qwen3Config

from hobson.attention import mask_mapping, supports_mask_mapping
from hobson.decider.collate import Collator
from hobson.decider.config import load_train_config
from hobson.decider.loss import decider_loss
from hobson.decider.model import build_decider
from hobson.io import read_jsonl
from tests.decider.conftest import micro_batch_loss

# ops that copy a device value to the host (.item(), bool(), float(), .tolist()) or whose output
# shape depends on the values (on a GPU the host waits for those too)
_READS = {"_local_scalar_dense", "is_nonzero", "item", "equal", "nonzero", "masked_select", "_unique2",
          "repeat_interleave"}


class _Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _torso(kind: str, attn: str) -> torch.nn.Module:
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, max_position_embeddings=64, pad_token_id=0)
    if kind == "qwen3_5":
        cfg = Qwen3_5TextConfig(**common, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2,
                                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                layer_types=["linear_attention"] * 3 + ["full_attention"])
    elif kind == "qwen3_sliding":
        cfg = Qwen3Config(**common, num_hidden_layers=2, use_sliding_window=True, sliding_window=5,
                          max_window_layers=1)
    else:
        cfg = Qwen3Config(**common, num_hidden_layers=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).model.eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3", "qwen3_sliding"])
def test_host_built_masks_give_the_torsos_own_outputs_bit_for_bit(kind, attn):
    torso = _torso(kind, attn)
    assert supports_mask_mapping(torso.config)
    if kind == "qwen3_sliding":
        assert "sliding_attention" in torso.config.layer_types
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (3, 12), generator=g)
    for lengths in ([12, 12, 12], [12, 7, 3]):  # nothing padded; right padding
        mask = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).long()
        padded = min(lengths) < 12
        with torch.no_grad():
            own = torso(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            mapped = torso(input_ids=ids, attention_mask=mask_mapping(torso.config, mask, padded, torch.float32),
                           use_cache=False).last_hidden_state
        assert torch.equal(mapped, own), (kind, attn, lengths)
    assert not supports_mask_mapping(type("C", (), {"model_type": "gemma3", "layer_types": None})())


def test_a_training_micro_batch_reads_nothing_back_from_the_device(decider_data, config_factory, tmp_path):
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out"))
    assert cfg.kl_teacher_weight > 0 and cfg.kl_frozen_weight > 0  # both KL terms, the frozen forward too
    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    model = build_decider(cfg, tok).train()
    rows = read_jsonl(decider_data["train"])[:6]
    batch = Collator(tok, max_length=1024, force_bos=False, seed=0).collate(list(enumerate(rows)))
    assert len({len(ids) for ids in batch.token_ids}) > 1  # padded: the masks are built, not skipped
    with _Reads() as reads:
        micro_batch_loss(model, batch, cfg)
    assert reads.seen == []


def test_rows_without_a_teacher_add_exactly_nothing():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, generator=g)
    mask = torch.tensor([[True, True, True]] * 3 + [[True, True, False]])
    args = (mask, torch.tensor([0, 2, 1, 1]), torch.tensor([False, True, False, False]),
            torch.tensor([1.0, 0.5, 2.0, 1.0]), torch.zeros(4, 3), torch.zeros(4, dtype=torch.bool))
    for direction in ("forward", "reverse"):
        grads, losses = [], []
        for w in (0.0, 0.7):  # weight 0 skips the term; 0.7 computes it over rows that have no teacher
            x = logits.clone().requires_grad_(True)
            loss, m = decider_loss(x, *args, kl_teacher_weight=w, kl_direction=direction)
            loss.backward()
            grads.append(x.grad)
            losses.append(loss.detach())
            assert m["kl_teacher"].item() == 0.0
        assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1]), direction
