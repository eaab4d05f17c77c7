"""Safetensors files written by many threads straight from CPU or GPU tensors.

``safetensors.torch.save_file`` builds the whole file in host memory first (every GPU tensor
copied to pageable memory, then its bytes copied again into one buffer) and writes it from one
thread. At the size of an official Huginn checkpoint (~35 GB of actor, critic and fp32 optimizer
state) that serial path was most of a 70-80 s background write, and the update waited on it.

:func:`save` lays out the same format (an 8-byte header length, a JSON header padded to 8 bytes,
then each tensor's bytes at its ``data_offsets``), sizes the file, and has the pool of
:mod:`hobson.bytepool` write pieces of at most 64 MiB with ``os.pwrite``: a CPU piece from the
tensor's own memory, a GPU piece through a pinned staging buffer on the thread's own CUDA stream.
No host copy of the whole is ever made. ``safetensors.torch.load_file`` reads the result.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from concurrent import futures

import torch

from hobson import bytepool, graphlock

PIECE = 64 << 20  # bytes per write: one pinned buffer each, and enough pieces to spread over threads

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}

# pinned staging buffers, made on first use and kept: pinning 64 MiB costs milliseconds, and a run
# writes a checkpoint every update. At most one per pool thread is in use at once (24 on a 16-CPU
# host: 1.5 GiB of pinned host memory held for the life of the process).
_STAGING: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
_STREAMS = threading.local()  # one CUDA stream per (thread, device): pieces copy concurrently


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its own device (no copy when it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write_cuda(fd: int, flat: torch.Tensor, start: int, stop: int, offset: int, ready: torch.cuda.Event) -> None:
    n = stop - start
    try:
        buf = _STAGING.get_nowait()
    except queue.Empty:
        buf = None
    with graphlock.CAPTURE:  # no CUDA call of ours while a graph records (hobson.graphlock)
        if buf is None or buf.numel() < n:  # none free, or one from before PIECE changed (tests)
            buf = torch.empty(max(PIECE, n), dtype=torch.uint8, pin_memory=True)
        streams = _STREAMS.__dict__.setdefault("by_device", {})
        stream = streams.get(flat.device) or streams.setdefault(flat.device, torch.cuda.Stream(flat.device))
        with torch.cuda.stream(stream):
            stream.wait_event(ready)  # what the caller's stream queued for these bytes is done first
            buf[:n].copy_(flat[start:stop], non_blocking=True)
        stream.synchronize()  # frees the GIL while the copy runs
    try:
        _pwrite_all(fd, buf[:n].numpy().data, offset)
    finally:
        _STAGING.put(buf)


def _write_cpu(fd: int, flat: torch.Tensor, start: int, stop: int, offset: int) -> None:
    _pwrite_all(fd, flat[start:stop].numpy().data, offset)


def save(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` as the safetensors file ``path``; returns its size in bytes.

    GPU tensors must not be changed while this runs (the background checkpoint passes private
    clones; an in-line caller has nothing else running). The copies wait for the work queued on
    the caller's current stream; nothing synchronizes the whole device.
    """
    names = sorted(tensors)
    flats = {n: _bytes(tensors[n]) for n in names}
    # An event per device on the caller's stream, which the copy streams wait for, rather than
    # torch.cuda.synchronize: a device-wide synchronize from the background writer waits on the
    # stream another thread may be capturing a CUDA graph on, which CUDA refuses. That is the
    # likely cause of one GPU failure of test_graph_decode_beside_a_copying_thread[huginn_raven-
    # tensorfile]; not yet re-run on a GPU (see docs/BENCHMARKS.md, session 16).
    ready: dict[torch.device, torch.cuda.Event] = {}
    for device in {f.device for f in flats.values() if f.is_cuda}:
        with graphlock.CAPTURE:
            ready[device] = torch.cuda.Event()
            ready[device].record(torch.cuda.current_stream(device))
    header: dict[str, object] = {}
    end = 0
    for n in names:
        t = tensors[n]
        if t.dtype not in DTYPES:
            raise TypeError(f"{n}: dtype {t.dtype} has no safetensors name")
        size = flats[n].numel()
        header[n] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [end, end + size]}
        end += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    base = 8 + len(head)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, len(head).to_bytes(8, "little") + head, 0)
        os.ftruncate(fd, base + end)
        jobs = []
        for n in names:
            flat, at = flats[n], base + header[n]["data_offsets"][0]  # type: ignore[index]
            for start in range(0, flat.numel(), PIECE):
                stop = min(start + PIECE, flat.numel())
                if flat.is_cuda:
                    jobs.append(bytepool.pool().submit(_write_cuda, fd, flat, start, stop, at + start,
                                                       ready[flat.device]))
                else:
                    jobs.append(bytepool.pool().submit(_write_cpu, fd, flat, start, stop, at + start))
        futures.wait(jobs)  # every piece done (or failed) before the descriptor closes
        for job in jobs:
            job.result()  # the first failure, if any
    finally:
        os.close(fd)
    return base + end


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())

