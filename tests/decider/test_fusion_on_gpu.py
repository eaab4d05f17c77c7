"""``chain_kernel: liger`` and the fused LoRA on a GPU: liger's Triton norm and SwiGLU kernels
give the model's outputs and gradients within bf16 rounding (the CPU tests show the routing and
that CPU tensors keep the model's numbers exactly)."""

from __future__ import annotations

import copy

import pytest
import torch

from hobson.decider.fusion import fuse_chains, fuse_lora, liger_functions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _torso(kind: str) -> torch.nn.Module:
    """A small bf16 torso on the GPU: Qwen3.5 (centred and gated norms) or Qwen3 (plain norms)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, pad_token_id=0)
    if kind == "qwen3_5":
        cfg = Qwen3_5TextConfig(**common, num_hidden_layers=4, linear_num_key_heads=4, linear_num_value_heads=4,
                                linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                layer_types=["linear_attention"] * 3 + ["full_attention"])
    else:
        cfg = Qwen3Config(**common, num_hidden_layers=2)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    return lm.model


def _run(torso: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (4, 48), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    out = torso(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    out.float().pow(2).mean().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in torso.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_liger_chains_match_the_model_within_bf16_rounding(kind):
    assert liger_functions() is not None, "liger-kernel does not import on this GPU host (pip install liger-kernel)"
    plain = _torso(kind)
    routed = copy.deepcopy(plain)
    assert fuse_chains(routed, "liger") > 0
    out_p, grads_p = _run(plain)
    out_r, grads_r = _run(routed)
    scale = out_p.abs().max()
    torch.testing.assert_close(out_r / scale, out_p / scale, rtol=0, atol=2e-2)
    assert grads_p.keys() == grads_r.keys() and len(grads_p) > 10
    for k in grads_p:  # every weight's gradient (norm weights included), relative to its largest entry
        s = grads_p[k].abs().max().clamp(min=1e-12)
        torch.testing.assert_close(grads_r[k] / s, grads_p[k] / s, rtol=0, atol=5e-2, msg=k)


def test_fused_lora_on_the_gpu_is_peft_sum_within_bf16_rounding():
    from peft import LoraConfig, get_peft_model

    def lora(t: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(2)
        m = get_peft_model(t, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj",
                                                                               "up_proj", "down_proj"]))
        with torch.no_grad():  # a non-zero B, so the adapter's product shows
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        return m

    base = _torso("qwen3")
    peft_model, fused = lora(copy.deepcopy(base)), lora(copy.deepcopy(base))
    assert fuse_lora(fused) == 2 * 5
    out_p, grads_p = _run(peft_model)
    out_f, grads_f = _run(fused)
    scale = out_p.abs().max()
    torch.testing.assert_close(out_f / scale, out_p / scale, rtol=0, atol=2e-2)
    assert grads_p.keys() == grads_f.keys()
    assert all("lora_" in k for k in grads_p) and grads_f
    # the adapter stays fp32 (the optimizer's copy); only its product runs in bf16
    assert all(p.dtype == torch.float32 for n, p in fused.named_parameters() if "lora_" in n)
    for k in grads_p:
        s = grads_p[k].abs().max().clamp(min=1e-12)
        torch.testing.assert_close(grads_f[k] / s, grads_p[k] / s, rtol=0, atol=5e-2, msg=k)
