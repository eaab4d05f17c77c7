"""``lora_kernel`` and ``chain_kernel`` (hobson.decider.fusion): what they reroute, and that the
numbers stay the model's: the chains bit for bit outside ``fused_kernels`` (CPU), the fused LoRA
the same sum as peft's within rounding, its adapter fp32 and trained."""

from __future__ import annotations

import copy

import pytest
import torch

from hobson.decider.config import load_train_config
from hobson.decider.fusion import fuse_chains, fuse_lora, liger_functions, lora_is_fused, resolve_chain_kernel
from hobson.errors import ConfigError


def _qwen35(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny Qwen3.5 text model: 3 Gated DeltaNet layers and 1 full attention, seeded."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                            linear_conv_kernel_dim=4, max_position_embeddings=64, tie_word_embeddings=True,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # non-trivial norm weights (zero-centred: 0 would be the identity scale)
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    return lm.model


def _run(torso: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.arange(1, 25).reshape(2, 12) % 64
    out = torso(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    out.pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in torso.named_parameters() if p.grad is not None}


def test_fused_chains_outside_the_context_are_the_models_numbers_bit_for_bit():
    plain = _qwen35()
    fused = copy.deepcopy(plain)
    # per layer: input and post-attention norms and the MLP; the attention's q/k norms; the Gated
    # DeltaNet layers' gated norm; the final norm
    assert fuse_chains(fused) == 4 * 3 + 2 + 3 + 1
    assert type(fused.layers[0].mlp).forward is type(plain.layers[0].mlp).forward  # classes untouched
    out_p, grads_p = _run(plain)
    out_f, grads_f = _run(fused)
    assert torch.equal(out_p, out_f)
    assert grads_p.keys() == grads_f.keys() and len(grads_p) > 20
    assert all(torch.equal(grads_p[k], grads_f[k]) for k in grads_p)


def _lora(torso: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(torso, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # B starts at zero in peft: give the adapter a non-zero product to compare
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_is_peft_sum_with_an_fp32_adapter(dtype, monkeypatch):
    from peft.tuners.lora.layer import Linear as LoraLinear

    peft_model = _lora(_qwen35(dtype))
    fused = copy.deepcopy(peft_model)
    assert fuse_lora(fused) == 4 * 3
    # count peft's own forward: the fused model must not fall back to it while its adapter is on
    peft_calls = []
    peft_forward = LoraLinear.forward

    def counting(self, *args, **kwargs):
        peft_calls.append(1)
        return peft_forward(self, *args, **kwargs)
    monkeypatch.setattr(LoraLinear, "forward", counting)
    ids = torch.arange(1, 25).reshape(2, 12) % 64

    def run(model):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        out.float().pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return out.detach().float(), grads

    out_p, grads_p = run(peft_model)
    assert len(peft_calls) == 4 * 3
    out_f, grads_f = run(fused)
    assert len(peft_calls) == 4 * 3  # the fused forward ran on every layer, no fallback
    # the adapter stays fp32 (the optimizer's copy) and every one of its weights gets a gradient
    assert all(p.dtype == torch.float32 for n, p in fused.named_parameters() if "lora_" in n)
    assert set(grads_f) == set(grads_p) and all(g is not None and g.dtype == torch.float32 for g in grads_f.values())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.05, atol=0.02)
    torch.testing.assert_close(out_f, out_p, **tol)
    for k in grads_p:
        scale = grads_p[k].abs().max()
        torch.testing.assert_close(grads_f[k] / scale, grads_p[k] / scale, **tol)
    # adapter off (the frozen-KL forward): peft's own forward, the base model's numbers exactly
    with peft_model.disable_adapter(), fused.disable_adapter(), torch.no_grad():
        base_p = peft_model(input_ids=ids).last_hidden_state
        base_f = fused(input_ids=ids).last_hidden_state
    assert torch.equal(base_p, base_f)


def test_the_settings_are_validated_and_auto_fuses_lora_for_bf16_only(config_factory, tmp_path):
    path = config_factory(tmp_path / "train.yaml", tmp_path / "out")
    with pytest.raises(ConfigError, match="lora_kernel 'triton' is not one of auto, peft, fused"):
        load_train_config(path, ["lora_kernel=triton"])
    with pytest.raises(ConfigError, match="chain_kernel 'maybe' is not one of auto, eager, liger, compiled"):
        load_train_config(path, ["chain_kernel=maybe"])
    with pytest.raises(ConfigError, match="Unknown key.*fused_chains|fused_chains"):  # retired: chain_kernel
        load_train_config(path, ["fused_chains=true"])
    assert lora_is_fused("auto", torch.bfloat16) and not lora_is_fused("auto", torch.float32)
    assert lora_is_fused("fused", torch.float32) and not lora_is_fused("peft", torch.bfloat16)


def test_a_cpu_run_with_compiled_chains_trains_the_same_state(config_factory, tmp_path):
    """On a CPU the chains run eagerly: a training step with ``chain_kernel: compiled`` gives the
    state dict of the run without, bit for bit (the trainer's fused_kernels block is CUDA only)."""
    from hobson.decider.train import DeciderTrainRecipe

    def trained(name: str, *sets: str) -> dict[str, torch.Tensor]:
        cfg = load_train_config(config_factory(tmp_path / f"{name}.yaml", tmp_path / name),
                                ["resume=false", "stop_after_steps=1", *sets])
        recipe = DeciderTrainRecipe(cfg)
        try:
            recipe.setup()
            assert recipe.train() == 0
            rerouted[name] = sum("forward" in vars(m) for m in recipe.model.torso.modules())
            return {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
        finally:
            recipe.cleanup()

    rerouted: dict[str, int] = {}
    plain = trained("plain")
    fused = trained("fused", "chain_kernel=compiled")
    assert list(fused) == list(plain)
    assert all(torch.equal(fused[k], plain[k]) for k in plain)
    # fp32 keeps peft's LoRA under auto; lora_kernel: fused trains through the fused forward in a
    # whole recipe step (its sum is peft's within rounding: the test above, layer by layer)
    lora = trained("lora", "lora_kernel=fused")
    assert rerouted["plain"] == 0 and rerouted["fused"] > 0 and rerouted["lora"] > 0
    assert list(lora) == list(plain)
    for k in plain:
        torch.testing.assert_close(lora[k], plain[k], rtol=0, atol=2e-3)  # within one Adam step of lr 1e-3


def test_chain_kernel_resolves_to_what_can_run_here():
    """``auto`` is liger only for a 16-bit torso on CUDA where liger-kernel imports; an explicit
    liger that cannot run is one clear error, not a fallback."""
    liger = liger_functions() is not None
    assert resolve_chain_kernel("auto", "cpu", torch.bfloat16) == "eager"
    assert resolve_chain_kernel("auto", "cuda", torch.float32) == "eager"
    assert resolve_chain_kernel("auto", "cuda", torch.bfloat16) == ("liger" if liger else "eager")
    assert resolve_chain_kernel("compiled", "cpu", torch.float32) == "compiled"
    with pytest.raises(ConfigError, match="chain_kernel: liger runs Triton kernels on CUDA only.*set chain_kernel"):
        resolve_chain_kernel("liger", "cpu", torch.float32)
    if not liger:
        with pytest.raises(ConfigError, match="needs the liger-kernel package"):
            resolve_chain_kernel("liger", "cuda", torch.bfloat16)


def test_liger_chains_given_cpu_tensors_are_the_models_numbers_bit_for_bit():
    """The liger forwards hand a CPU tensor to the module's own forward: outputs and gradients of a
    rerouted torso equal the plain torso's exactly (the Triton kernels are tested on a GPU)."""
    plain = _qwen35()
    routed = copy.deepcopy(plain)
    n = fuse_chains(routed, "liger")
    assert n == sum(type(m).__name__ in ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP")
                    for m in plain.modules())
    out_p, grads_p = _run(plain)
    out_r, grads_r = _run(routed)
    assert torch.equal(out_p, out_r)
    assert grads_p.keys() == grads_r.keys() and all(torch.equal(grads_p[k], grads_r[k]) for k in grads_p)


def _autograd_lora(x, weight, bias, a, b, scaling):
    """The fused LoRA's products as plain autograd composes them (the reference for its backward)."""
    base = torch.nn.functional.linear(x, weight, bias)
    h = torch.nn.functional.linear(x, a.to(x.dtype))
    out = torch.addmm(base.reshape(-1, base.shape[-1]), h.reshape(-1, h.shape[-1]), b.to(x.dtype).t(), alpha=scaling)
    return out.view(base.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_function_keeps_autograds_numbers_in_fewer_ops(dtype):
    """One autograd node: the output and the adapter's gradients are autograd's bits; the input's
    gradient is too in fp32 and one rounding apart in bf16 (its two parts meet inside a GEMM
    instead of an add); and the forward+backward dispatches fewer ops, the add among them."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from hobson.decider.fusion import LoraLinearFunction

    class Census(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 64, generator=g).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    a0, b0 = torch.randn(8, 64, generator=g) * 0.1, torch.randn(80, 8, generator=g) * 0.1
    x0, grad = torch.randn(2, 48, 64, generator=g).to(dtype), torch.randn(2, 48, 80, generator=g).to(dtype)
    got = {}
    for name, f in (("autograd", _autograd_lora), ("function", LoraLinearFunction.apply)):
        a, b, x = a0.clone().requires_grad_(), b0.clone().requires_grad_(), x0.clone().requires_grad_()
        with Census() as census:
            out = f(x, weight, bias, a, b, 2.0)
            out.backward(grad)
        got[name] = (out.detach(), x.grad, a.grad, b.grad, census.ops)
    (out_r, dx_r, da_r, db_r, ops_r), (out_f, dx_f, da_f, db_f, ops_f) = got["autograd"], got["function"]
    assert torch.equal(out_f, out_r) and torch.equal(da_f, da_r) and torch.equal(db_f, db_r)
    assert da_f.dtype == db_f.dtype == torch.float32 and db_f.is_contiguous()
    if dtype == torch.float32:
        assert torch.equal(dx_f, dx_r)
    else:  # one rounding fewer: as close to the exact sum as autograd's, within one ulp of its parts
        g2 = grad.reshape(-1, 80).double()
        gh = (g2 @ b0.to(dtype).double()).to(dtype).double() * 2.0
        parts = g2 @ weight.double(), gh.to(dtype).double() @ a0.to(dtype).double()
        exact = (parts[0] + parts[1]).view(x0.shape)
        size = torch.maximum(parts[0].abs(), parts[1].abs()).view(x0.shape).clamp(min=1e-30)
        ulp = 2.0 ** (torch.floor(torch.log2(size)) - 7)
        err_f, err_r = (dx_f.double() - exact).abs(), (dx_r.double() - exact).abs()
        assert (err_f <= err_r + ulp).all() and err_f.mean() <= 1.01 * err_r.mean()
    assert sum(ops_f.values()) < sum(ops_r.values()) * 0.7 and "aten.add" not in ops_f, (ops_f, ops_r)
    # an input that needs no gradient (the first projection after a frozen embedding) gets none
    x = x0.clone()
    a = a0.clone().requires_grad_()
    LoraLinearFunction.apply(x, weight, None, a, b0, 2.0).sum().backward()
    assert x.grad is None and a.grad is not None
