"""Fewer, larger kernels for a LoRA torso's training step on a GPU (settings ``lora_kernel`` and
``chain_kernel``).

Why: a profile of a bf16 Qwen3.5-2B-shaped step (docs/BENCHMARKS.md, "Decider training on fla's
kernels") spent half its kernel time in elementwise and copy/cast kernels, 16k kernels a step,
and the GPU idled a third of it while the host launched them. Two sources are removed here
without compiling whole layers (whose warm-up did not finish in 250 s):

- **LoRA** (``lora_kernel``). peft keeps a bf16 torso's adapter in fp32 and computes
  ``result + lora_B(lora_A(x.float())) * scaling`` per projection: a cast of ``x``, two fp32
  products, then a scale, an add and a cast back over the whole ``(tokens, out)`` output, and
  their backward, on seven projections per layer. ``fused`` computes the same sum in the torso's
  dtype as ``result + scaling * (x @ A^T) @ B^T``, the add and the scaling inside the second
  product's GEMM (``addmm``), as one autograd node with its own backward
  (``LoraLinearFunction``). The adapter's weights stay fp32 (the optimizer's copy); only their
  product runs in bf16, as the frozen weights' does. ``auto``: ``fused`` for a bf16 torso, peft's own forward
  otherwise (fp32: CPU runs keep peft's numbers).
- **Norm and activation chains** (``chain_kernel``). An RMSNorm is eight kernels forward and a
  dozen backward through fp32 copies of its input, ``silu(gate) * up`` three and four. ``liger``
  runs each as one Triton kernel forward and one backward (the liger-kernel package's
  ``LigerRMSNormFunction`` and ``LigerSiLUMulFunction``; no compile step, so no warm-up);
  ``compiled`` runs them as hobson's ``@fused`` functions, compiled inside
  ``hobson.models.common.fused_kernels`` (the trainer opens it for a CUDA step; its inductor
  compiles did not finish a first step in 145-200 s on an H200, docs/BENCHMARKS.md session 19);
  ``eager`` is the model's own code. ``auto``: ``liger`` for a 16-bit torso on CUDA when
  liger-kernel imports, ``eager`` otherwise. A liger forward given a CPU tensor runs the model's
  own code, so the numbers off the GPU are the model's bit for bit.

Both change rounding only; a run records them as run control, like ``gated_delta_rule``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from hobson.errors import ConfigError
from hobson.models.common import fused, rms_norm, silu_mul

CHAIN_KERNELS = ("auto", "eager", "liger", "compiled")

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


def liger_functions() -> tuple[Any, Any] | None:
    """liger-kernel's ``(LigerRMSNormFunction, LigerSiLUMulFunction)``, or None where it does not
    import (not installed; no Triton, as on a CPU-only host)."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:  # ImportError, or Triton failing to find a GPU driver at import
        return None
    return LigerRMSNormFunction, LigerSiLUMulFunction


def resolve_chain_kernel(setting: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """What ``chain_kernel`` means here: ``eager``, ``liger`` or ``compiled`` (``auto``: ``liger``
    for a 16-bit torso on CUDA when liger-kernel imports). An explicit ``liger`` that cannot run is
    a :class:`ConfigError` naming what to change."""
    if setting not in CHAIN_KERNELS:
        raise ConfigError(f"chain_kernel {setting!r} is not one of {', '.join(CHAIN_KERNELS)}")
    cuda = torch.device(device).type == "cuda"
    if setting == "auto":
        return "liger" if cuda and dtype != torch.float32 and liger_functions() is not None else "eager"
    if setting == "liger":
        if not cuda:
            raise ConfigError(f"chain_kernel: liger runs Triton kernels on CUDA only, and this run's device is "
                              f"{torch.device(device).type}; set chain_kernel: auto or eager")
        if liger_functions() is None:
            raise ConfigError("chain_kernel: liger needs the liger-kernel package (pip install liger-kernel), "
                              "which does not import here; install it or set chain_kernel: auto")
    return setting


def _liger_plain_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    if not x.is_cuda:
        return type(self).forward(self, x)
    # "llama" casting: the normalised x cast back to x's dtype, then times the weight (Llama's order)
    return liger_functions()[0].apply(x, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _liger_centred_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    if not x.is_cuda:
        return type(self).forward(self, x)
    # "gemma" casting with offset 1: norm(x) * (1 + weight) all in fp32, cast once (Qwen3.5's order)
    return liger_functions()[0].apply(x, self.weight, self.eps, 1.0, "gemma", False)


def _liger_gated_norm_forward(self: nn.Module, x: Tensor, gate: Tensor) -> Tensor:
    if not x.is_cuda:
        return type(self).forward(self, x, gate)
    rms, silu_and_mul = liger_functions()
    # weight * norm(x) in x's dtype (as the model's), then silu(gate) * that; the model keeps the
    # product in fp32 until its one cast, here silu(gate) is rounded to x's dtype first
    return silu_and_mul.apply(gate, rms.apply(x, self.weight, self.variance_epsilon, 0.0, "llama", False))


def _liger_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    if not x.is_cuda:
        return type(self).forward(self, x)
    return self.down_proj(liger_functions()[1].apply(self.gate_proj(x), self.up_proj(x)))


# the forwards each kernel choice installs: plain norm, centred norm, gated norm, gated MLP
_FORWARDS = {
    "compiled": (_plain_norm_forward, _centred_norm_forward, _gated_norm_forward, _mlp_forward),
    "liger": (_liger_plain_norm_forward, _liger_centred_norm_forward, _liger_gated_norm_forward, _liger_mlp_forward),
}


def fuse_chains(torso: nn.Module, kernel: str = "compiled") -> int:
    """Route ``torso``'s norms and gated MLPs through ``kernel``'s chains (``compiled`` or
    ``liger``; per instance: the classes stay untouched); returns how many modules were rerouted."""
    plain, centred, gated, mlp = _FORWARDS[kernel]
    n = 0
    for m in torso.modules():
        name = type(m).__name__
        if name in PLAIN_NORMS and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(plain, m)
        elif name in CENTRED_NORMS and hasattr(m, "eps"):
            m.forward = types.MethodType(centred, m)
        elif name in GATED_NORMS and getattr(m, "activation", None) == "silu":
            m.forward = types.MethodType(gated, m)
        elif all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(m, "act_fn", None)):
            m.forward = types.MethodType(mlp, m)
        else:
            continue
        n += 1
    return n


def _plain_adapter(self: nn.Module) -> str | None:
    """The one active adapter's name when it is plain (no dropout, variant or bias, over an
    ``nn.Linear``), else None; decided once per set of active adapters (the checks cost more host
    time than the adapter's kernels take to launch, on every projection of every forward)."""
    key = tuple(self.active_adapters)
    cached = self.__dict__.get("_hobson_plain_adapter")
    if cached is not None and cached[0] == key:
        return cached[1]
    active = [a for a in key if a in self.lora_A]
    plain = (len(active) == 1 and isinstance(self.base_layer, nn.Linear)
             and active[0] not in getattr(self, "lora_variant", {})
             and isinstance(self.lora_dropout[active[0]], nn.Identity)
             and self.lora_A[active[0]].bias is None and self.lora_B[active[0]].bias is None)
    name = active[0] if plain else None
    self.__dict__["_hobson_plain_adapter"] = (key, name)
    return name


class LoraLinearFunction(torch.autograd.Function):
    """``x W^T (+ bias) + scaling * (x A^T) B^T`` for a frozen ``W``, as one autograd node.

    Why: autograd's version of the same products is a dozen nodes per projection (the casts of
    the fp32 adapter, the views, the alpha's multiply, the two products' backwards, and an add
    where the two gradients reaching ``x`` meet), each with its host time, on a step the host
    bounds (docs/BENCHMARKS.md, session 22). Here the backward is five products and one small
    scale: the frozen path's input gradient and the adapter's meet inside the second product
    (``addmm``), one rounding instead of two. The adapter's gradients are the same operations
    autograd runs (``(g B) s``, then its product with ``x`` or ``h``), so they keep its bits."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        h = x2.mm(a.t())
        out = torch.addmm(nn.functional.linear(x2, weight, bias), h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, h, weight, a, b)
        ctx.scaling, ctx.in_shape = scaling, x.shape
        ctx.adapter_dtypes = (lora_a.dtype, lora_b.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x2, h, weight, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gh = g.mm(b) * ctx.scaling  # the gradient reaching h = x A^T
        dx = torch.addmm(g.mm(weight), gh, a).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
        da = gh.t().mm(x2).to(ctx.adapter_dtypes[0])
        db = (g.t().mm(h) * ctx.scaling).to(ctx.adapter_dtypes[1])  # (out, r) as the parameter is laid out
        return dx, None, None, da, db, None


def _fused_lora_forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """peft's ``lora.Linear.forward`` for one plain adapter over a frozen projection, as
    :class:`LoraLinearFunction`; any other case (adapter off or merged, dropout, DoRA and other
    variants, several adapters, a trainable base, extra arguments) is peft's own forward."""
    base = self.base_layer
    if self.disable_adapters and not self.merged and not args and not kwargs:
        return base(x)  # the frozen forward: what peft's forward does here, without its checks
    a = None if args or kwargs or self.disable_adapters or self.merged else _plain_adapter(self)
    if a is None or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return type(self).forward(self, x, *args, **kwargs)
    return LoraLinearFunction.apply(x, base.weight, base.bias, self.lora_A[a].weight, self.lora_B[a].weight,
                                    self.scaling[a])


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


__all__ = ["CHAIN_KERNELS", "LoraLinearFunction", "centred_rms_norm", "fuse_chains", "fuse_lora", "gated_rms_norm",
           "liger_functions", "lora_is_fused", "resolve_chain_kernel"]
