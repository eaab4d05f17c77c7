"""CUDA graphs of the decider's micro-batch: forward, frozen forward, loss and backward as one replay.

Why: at the 2B shape one micro-batch is about 20,000 host ops (transformers' layer code, fla's
and liger's wrappers, autograd); at 128 rows the host's launches take about as long as the GPU's
kernels, so the GPU waits between them. Replaying a captured graph launches the same kernels
with one call.

A graph replays fixed shapes at fixed addresses, so each micro-batch is padded to its bucket:
rows to ``micro_batch_size``, length to a multiple of ``graph_length_multiple``, option slots to a
multiple of 8. Pad rows (:func:`pad_batch`) hold one token and one option, label -1, weight 0
and no teacher: log-softmax over one option is exactly 0 with gradient exactly 0, so every loss
term and gradient they add is 0, and label -1 is never counted correct. Each bucket's batch is
copied into that bucket's input tensors, then its graph replays.

Every micro-batch's gradient comes from a replay, a bucket's first one too: on first sight the
bucket is run once eagerly (its gradients put back: this fills autotuning and workspaces),
captured, then replayed. So which micro-batch meets a bucket first (after a resume, say) never
changes the numbers.

Memory: all graphs share one pool, and a replay's temporaries live only inside it (its one
output, the loss sums, is read before the next replay is queued). Session 23 found 50 GiB held
in the pool after a few 8-token buckets at 128 rows, for two reasons this module now avoids:
the eager warm-up ran outside the pool on a fresh side stream each time (the caching allocator
keeps a stream's freed blocks for that stream only, so every warm-up took new memory), and each
longer bucket's activations fit none of the shorter buckets' freed segments. So the warm-up and
the capture both run on one stream into the pool (one footprint, reused by every bucket), and
the allocator uses expandable segments (one growing segment per pool and stream instead of one
exact-size segment per large tensor).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hobson.decider.collate import Batch

OPTION_MULTIPLE = 8

# forward, loss and backward of one micro-batch; returns the loss sums as one float64 vector
Body = Callable[[Batch, "torch.Tensor | None", torch.Tensor], torch.Tensor]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_batch(batch: Batch, *, rows: int, length: int, options: int, pad_id: int) -> Batch:
    """``batch`` (on the host) padded to ``rows x length`` tokens and ``options`` slots (module doc)."""
    B, T = batch.input_ids.shape
    N = batch.option_pos.shape[1]
    if B > rows or T > length or N > options:
        raise ValueError(f"a {B}x{T} batch with {N} options does not fit the {rows}x{length}x{options} bucket")
    input_ids = torch.full((rows, length), pad_id, dtype=batch.input_ids.dtype)
    input_ids[:B, :T] = batch.input_ids
    attention_mask = torch.zeros((rows, length), dtype=batch.attention_mask.dtype)
    attention_mask[:B, :T] = batch.attention_mask
    attention_mask[B:, 0] = 1
    answer_pos = torch.zeros(rows, dtype=batch.answer_pos.dtype)
    answer_pos[:B] = batch.answer_pos
    option_pos = torch.zeros((rows, options), dtype=batch.option_pos.dtype)
    option_pos[:B, :N] = batch.option_pos
    option_mask = torch.zeros((rows, options), dtype=torch.bool)
    option_mask[:B, :N] = batch.option_mask
    option_mask[B:, 0] = True
    # slots past a row's own take their own index: a real row's perm is a permutation of 0..N-1,
    # so the scatter into canonical order stays one-to-one
    perm = torch.arange(options, dtype=batch.perm.dtype).repeat(rows, 1)
    perm[:B, :N] = batch.perm
    label = torch.full((rows,), -1, dtype=batch.label.dtype)
    label[:B] = batch.label
    is_score = torch.zeros(rows, dtype=torch.bool)
    is_score[:B] = batch.is_score
    weight = torch.zeros(rows, dtype=batch.weight.dtype)
    weight[:B] = batch.weight
    teacher = torch.zeros((rows, options), dtype=batch.teacher.dtype)
    teacher[:B, :N] = batch.teacher
    has_teacher = torch.zeros(rows, dtype=torch.bool)
    has_teacher[:B] = batch.has_teacher
    return Batch(input_ids, attention_mask, answer_pos, option_pos, option_mask, perm, label, is_score, weight,
                 teacher, has_teacher, list(batch.row_index), list(batch.token_ids) + [[pad_id]] * (rows - B))


def pad_logits(x: torch.Tensor, rows: int, options: int) -> torch.Tensor:
    out = torch.zeros((rows, options), dtype=x.dtype)
    out[: x.shape[0], : x.shape[1]] = x
    return out


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: Batch  # the bucket's input tensors, on the device
    frozen: torch.Tensor | None
    scale: torch.Tensor
    out: torch.Tensor  # the loss sums the replay writes


class MicroBatchGraphs:
    """One CUDA graph per bucket of the micro-batch ``body``; :meth:`run` pads, copies in, replays."""

    def __init__(self, body: Body, params: list[torch.nn.Parameter], device: torch.device, *, rows: int,
                 length_multiple: int, pad_id: int) -> None:
        self.body = body
        self.params = params
        self.device = device
        self.rows = rows
        self.length_multiple = length_multiple
        self.pad_id = pad_id
        use_expandable_segments()
        self.stream = torch.cuda.Stream(device)  # warm-ups and captures: one stream, so one set of blocks
        self.pool = torch.cuda.graph_pool_handle()
        # an empty graph holds the pool open between captures (a warm-up's release would free it)
        self._keepalive = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():  # "the CUDA Graph is empty": it is meant to be
            warnings.simplefilter("ignore")
            with torch.cuda.graph(self._keepalive, pool=self.pool, stream=self.stream):
                pass
        self.graphs: dict[tuple[int, int, bool, bool], _Captured] = {}
        self.captures = 0
        self._grad_ptrs: list[int] = []  # where the captured graphs add the gradients

    def pool_bytes(self) -> int:
        """Device memory the graphs' pool holds (segments, allocated or cached)."""
        pool = tuple(self.pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s.get("segment_pool_id", (0, 0))) == pool)

    def bucket(self, batch: Batch) -> tuple[int, int]:
        T = batch.input_ids.shape[1]
        return round_up(T, self.length_multiple), round_up(batch.option_pos.shape[1], OPTION_MULTIPLE)

    def run(self, batch: Batch, frozen: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Add ``batch``'s scaled gradient to the parameters' ``.grad``; its loss sums (device).

        ``batch`` and ``frozen`` (precomputed frozen-KL logits, or None) are on the host."""
        length, options = self.bucket(batch)
        padded = pad_batch(batch, rows=self.rows, length=length, options=options, pad_id=self.pad_id)
        # the padding flag decides the masks' form inside the graph, so it is part of the key
        is_padded = any(len(ids) < length for ids in padded.token_ids)
        key = (length, options, is_padded, frozen is not None)
        host_frozen = None if frozen is None else pad_logits(frozen, self.rows, options)
        if self._grad_ptrs and [p.grad.data_ptr() if p.grad is not None else 0 for p in self.params] != self._grad_ptrs:
            # a replay adds into the .grad tensors of the first capture; new ones would stay zero
            raise RuntimeError("the parameters' .grad tensors were replaced since the CUDA graphs were captured; "
                               "zero them in place (zero_grad(set_to_none=False)) when cuda_graphs is on")
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(padded, host_frozen)
            self.graphs[key] = entry
        else:
            _copy_in(entry, padded, host_frozen)
        entry.batch.token_ids = padded.token_ids
        entry.batch.row_index = padded.row_index
        entry.scale.fill_(scale)
        entry.graph.replay()
        return entry.out

    def _capture(self, padded: Batch, frozen: torch.Tensor | None) -> _Captured:
        for p in self.params:
            if p.grad is None:  # the graph adds into .grad in place, at addresses fixed from now on
                p.grad = torch.zeros_like(p)
        self._grad_ptrs = [p.grad.data_ptr() for p in self.params]
        batch = padded.to(self.device)
        dev_frozen = None if frozen is None else frozen.pin_memory().to(self.device, non_blocking=True)
        scale = torch.ones((), dtype=torch.float32, device=self.device)
        saved = [p.grad.clone() for p in self.params]
        # warm-up: autotuning, workspaces and lazy state, off the capture, in the pool's memory
        with self._in_pool():
            self.body(batch, dev_frozen, scale)
        for p, g in zip(self.params, saved, strict=True):
            p.grad.copy_(g)
        del saved
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = self.body(batch, dev_frozen, scale)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.captures += 1
        return _Captured(graph, batch, dev_frozen, scale, out)

    @contextmanager
    def _in_pool(self) -> Iterator[None]:
        """Eager work on the capture stream whose every allocation (the autograd thread's too) comes
        from the graphs' pool. Nothing else runs meanwhile: the routing is device-wide."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        torch._C._cuda_beginAllocateToPool(index, self.pool)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            torch._C._cuda_endAllocateToPool(index, self.pool)
            torch._C._cuda_releasePool(index, self.pool)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def use_expandable_segments() -> None:
    """Turn on the allocator's expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` chose.

    Each bucket's activations differ in size; with one exact-size segment per large tensor a
    longer bucket cannot reuse a shorter one's, and the pool grows by each bucket's footprint."""
    if "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _copy_in(entry: _Captured, padded: Batch, frozen: torch.Tensor | None) -> None:
    # pinned and not waited for (a pageable copy waits for the GPU); the caching host allocator
    # keeps each pinned buffer until its copy has run
    for name, dst in entry.batch.__dict__.items():
        if isinstance(dst, torch.Tensor):
            dst.copy_(getattr(padded, name).pin_memory(), non_blocking=True)
    if entry.frozen is not None and frozen is not None:
        entry.frozen.copy_(frozen.pin_memory(), non_blocking=True)
