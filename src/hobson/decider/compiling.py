"""``compile_layers``: every decoder layer of the torso under ``torch.compile``, in place.

Why: on a GPU half of a decider step's kernel time is elementwise and cast work around the
matmuls (LoRA's scale and add on seven projections, RMSNorm's fp32 round trip, the casts around
the frozen forward), each its own kernel launched from Python. Compiling a layer fuses those
chains into a few generated kernels (docs/BENCHMARKS.md, "Decider training: the MFU target").

How: ``nn.Module.compile`` on each layer transformers marks as one (``GradientCheckpointingLayer``),
so parameter names, the state dict, LoRA's adapter state and gradient checkpointing stay exactly
as without it; only the layer's call goes through dynamo. Shapes are compiled as dynamic from the
start (``dynamic=True``), so which kernels run for a given length does not depend on which
lengths came first: a resumed run, or another DDP rank, sees its lengths in another order and
must still compute the same numbers as the uninterrupted single process. Each layer gets graphs
of its own (a transformers layer specializes on its own index: 8 layers gave 8 graphs on CPU), so
a 24-layer torso compiles 24 times per variant (grad mode: training vs the frozen-KL forward; the
adapter on or off); the graph limits are raised to cover every layer's variants, or dynamo would
silently run the layers past the limit uncompiled.

A Gated DeltaNet layer's chunked rule stays outside the graphs (the recipe opens
``select_gated_delta_rule`` with ``opaque=True``): it runs as ``gated_delta_rule`` says, fla's
kernels included, and dynamo neither traces into fla's triton code nor unrolls the torch
function's chunk loop; it compiles the work around the rule.

A compiled layer rounds differently from the eager one (fused arithmetic), so a run's numbers
depend on this setting like on ``gated_delta_rule``; both are run control, as the kernel is.
"""

from __future__ import annotations

import torch

from hobson.errors import ConfigError

RECOMPILE_LIMIT = 64  # graphs per code object: grad mode x adapter on/off x chunk counts
VARIANTS_PER_LAYER = 8  # grad mode x adapter on/off, with room for a length-class guard


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's per-function graph limits to at least ``limit`` (never lower them)."""
    dyn = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dyn, knob):
            setattr(dyn, knob, max(getattr(dyn, knob), limit))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers runs as decoder layers (its gradient-checkpointing unit)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_decoder_layers(model: torch.nn.Module, *, backend: str = "inductor") -> int:
    """Compile each decoder layer of ``model`` in place; returns how many were compiled."""
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(f"compile_layers: true, but the torso ({type(model).__name__}) has no decoder layers "
                          "transformers marks as such; set compile_layers: false")
    allow_recompiles(max(RECOMPILE_LIMIT, VARIANTS_PER_LAYER * len(layers)))
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


__all__ = ["allow_recompiles", "compile_decoder_layers", "decoder_layers"]
