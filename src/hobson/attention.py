"""Attention for batches whose shape changes from call to call: which fused kernels SDPA may
pick, and each layer type's mask built without reading the mask's values back from the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Every backend but cuDNN's, in SDPA's own order of preference.
_SHAPE_FREE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def varying_shape_sdpa() -> Iterator[None]:
    """SDPA without the cuDNN backend, for the labeller's and the decider's batches.

    Both pack rows by length, so nearly every batch has a new ``[rows, length]`` shape, and
    cuDNN's attention builds (and caches) an execution graph per shape. Profiled on an H200
    (torch 2.11, Qwen3.5-2B-shaped decider training at micro-batch 64): 1.55 s of host time per
    optimizer step in ``_cudnn_attention_forward/backward`` out of 2.56 s; labelling's forwards
    ran at 0.56 of the fixed-shape throughput. Flash and memory-efficient attention need no plan.
    The flags are process-wide (SDPA reads them on every call, the backward included), so a
    training step keeps the context open over its backward too, where checkpointing recomputes.
    """
    with sdpa_kernel(_SHAPE_FREE):
        yield


# Torsos whose forward takes a ``{layer type: mask}`` mapping in place of the 2D mask (transformers'
# "already prepared" path), and the layer types this module can build masks for.
_MAPPED_MODEL_TYPES = frozenset({"qwen3", "qwen3_5", "qwen3_5_text"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "linear_attention"})


def supports_mask_mapping(config: Any) -> bool:
    """Whether :func:`mask_mapping` can stand in for ``config``'s torso's own mask building."""
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return getattr(config, "model_type", None) in _MAPPED_MODEL_TYPES and types <= _LAYER_TYPES


def mask_mapping(config: Any, attention_mask: torch.Tensor, padded: bool, dtype: torch.dtype) -> dict[str, Any]:
    """Each layer type's mask for a right-padded ``(B, T)`` batch, as transformers' own builders
    make them, given ``padded`` (whether any row is shorter than ``T``) from the host.

    Why: the builders decide whether a mask is needed by reading the mask (``torch.all(mask == 1)``
    for the recurrent layers, the SDPA causal-skip check for the others), a device-to-host sync
    per builder call, two per forward: on a GPU each one waits for every kernel queued before it,
    so the host cannot run ahead of the GPU through a training step. Given ``padded``, the same
    masks come from the builders without a read: no mask (and SDPA's causal path) when nothing is
    padded, the full mask without the skip check when something is.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    B, T = attention_mask.shape
    # the builders read only the shape, dtype and device of the embeddings: a zero-size stand-in
    embeds = torch.empty((B, T, 0), dtype=dtype, device=attention_mask.device)
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(getattr(config, "layer_types", None) or ["full_attention"]):
        if kind == "linear_attention":  # what create_recurrent_attention_mask returns, without its read
            out[kind] = attention_mask.contiguous() if padded else None
            continue
        build = create_causal_mask if kind == "full_attention" else create_sliding_window_causal_mask
        out[kind] = build(config, embeds, attention_mask if padded else None, None, allow_is_causal_skip=not padded)
    return out
