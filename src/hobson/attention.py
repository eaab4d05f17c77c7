"""Which fused attention kernels SDPA may pick for batches whose shape changes from call to call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
