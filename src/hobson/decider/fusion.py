"""Fewer, larger kernels for a LoRA torso's training step on a GPU (settings ``lora_kernel`` and
``fused_chains``).

Why: a profile of a bf16 Qwen3.5-2B-shaped step (docs/BENCHMARKS.md, "Decider training on fla's
kernels") spent half its kernel time in elementwise and copy/cast kernels, 16k kernels a step,
and the GPU idled a third of it while the host launched them. Two sources are removed here
without compiling whole layers (whose warm-up did not finish in 250 s):

- **LoRA** (``lora_kernel``). peft keeps a bf16 torso's adapter in fp32 and computes
  ``result + lora_B(lora_A(x.float())) * scaling`` per projection: a cast of ``x``, two fp32
  products, then a scale, an add and a cast back over the whole ``(tokens, out)`` output, and
  their backward, on seven projections per layer. ``fused`` computes the same sum in the torso's
  dtype as ``result += (x @ A^T) @ (scaling * B)^T``, the add inside the second product's GEMM
  (``addmm_``, in place on the frozen product's output). The adapter's weights stay fp32 (the
  optimizer's copy); only their product runs in bf16, as the frozen weights' does. ``auto``:
  ``fused`` for a bf16 torso, peft's own forward otherwise (fp32: CPU runs keep peft's numbers).
- **Norm and activation chains** (``fused_chains``). Inside ``hobson.models.common.fused_kernels``
  (the trainer opens it for a CUDA step's forward and backward) each RMSNorm, Gated DeltaNet's gated
  norm and the MLP's ``silu(gate) * up`` run as one compiled kernel each (compiled for dynamic
  shapes), the fp32 round trip of a norm included. Off by default: on an H200 the first step did
  not finish in 145-200 s of compiling (docs/BENCHMARKS.md, session 19). Outside it (CPU) they
  run the eager operations the model's own code runs, in the same order, so the numbers are the
  model's bit for bit (tested).

Both change rounding only; a run records them as run control, like ``gated_delta_rule``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from hobson.models.common import fused, rms_norm, silu_mul

# transformers' RMSNorm classes by formula: ``weight * norm(x)`` cast as Llama does, ``(1 + weight)``
# zero-centred (Qwen3.5 / Qwen3-Next), and the gated norm of their Gated DeltaNet layers
PLAIN_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
CENTRED_NORMS = frozenset({"Qwen3_5RMSNorm", "Qwen3NextRMSNorm"})
GATED_NORMS = frozenset({"Qwen3_5RMSNormGated", "Qwen3NextRMSNormGated"})


@fused
def centred_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's norm: ``norm(x.float()) * (1 + weight.float())``, cast back (its own order of ops)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


@fused
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's Gated DeltaNet output norm: ``weight * norm(x)`` times ``silu(gate)``, in fp32."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * nn.functional.silu(gate.to(torch.float32))).to(dtype)


def _plain_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon)


def _centred_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    return centred_rms_norm(x, self.weight, self.eps)


def _gated_norm_forward(self: nn.Module, x: Tensor, gate: Tensor) -> Tensor:
    return gated_rms_norm(x, gate, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fuse_chains(torso: nn.Module) -> int:
    """Route ``torso``'s norms and gated MLPs through the fusable functions above (per instance:
    the classes stay untouched); returns how many modules were rerouted."""
    n = 0
    for m in torso.modules():
        name = type(m).__name__
        if name in PLAIN_NORMS and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_plain_norm_forward, m)
        elif name in CENTRED_NORMS and hasattr(m, "eps"):
            m.forward = types.MethodType(_centred_norm_forward, m)
        elif name in GATED_NORMS and getattr(m, "activation", None) == "silu":
            m.forward = types.MethodType(_gated_norm_forward, m)
        elif all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(m, "act_fn", None)):
            m.forward = types.MethodType(_mlp_forward, m)
        else:
            continue
        n += 1
    return n


def _fused_lora_forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """peft's ``lora.Linear.forward`` for one plain adapter, its add inside the second GEMM; any
    other case (adapter off or merged, dropout, DoRA and other variants, several adapters, extra
    arguments) is peft's own forward."""
    active = [a for a in self.active_adapters if a in self.lora_A]
    plain = (len(active) == 1 and isinstance(self.base_layer, nn.Linear) and not args and not kwargs
             and not self.disable_adapters and not self.merged
             and active[0] not in getattr(self, "lora_variant", {})
             and isinstance(self.lora_dropout[active[0]], nn.Identity)
             and self.lora_A[active[0]].bias is None and self.lora_B[active[0]].bias is None)
    if not plain:
        return type(self).forward(self, x, *args, **kwargs)
    a = active[0]
    result = self.base_layer(x)
    if not result.is_contiguous():
        result = result.contiguous()
    h = nn.functional.linear(x, self.lora_A[a].weight.to(x.dtype))
    update = (self.lora_B[a].weight * self.scaling[a]).to(result.dtype)
    result.view(-1, result.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), update.t())
    return result


def fuse_lora(torso: nn.Module) -> int:
    """Give every peft LoRA Linear of ``torso`` the fused forward; returns how many."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no peft, no LoRA layers
        return 0
    n = 0
    for m in torso.modules():
        if isinstance(m, LoraLinear):
            m.forward = types.MethodType(_fused_lora_forward, m)
            n += 1
    return n


def lora_is_fused(setting: str, dtype: torch.dtype) -> bool:
    """What ``lora_kernel`` means for a torso of ``dtype`` (``auto``: fused unless fp32)."""
    return setting == "fused" or (setting == "auto" and dtype != torch.float32)


__all__ = ["centred_rms_norm", "fuse_chains", "fuse_lora", "gated_rms_norm", "lora_is_fused"]
