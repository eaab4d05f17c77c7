"""One process-wide thread pool for byte work that frees the GIL (hashing, pread/pwrite, copies).

hashlib releases the GIL for buffers over 2 KiB, os.pread/os.pwrite around the system call and
torch around a CUDA stream synchronize, so threads run such work on as many cores as they have:
on the 16-core H200 host 16 threads hashed 16.7 GB in 1.07 s (issue 19's figure).
The pool is shared, not made per call. Work off the update's critical path (the background
checkpoint writer) runs inside :func:`background`, which gives its thread a second, smaller pool:
one FIFO for both put the next update's publication behind every queued checkpoint piece (on an
H200 host a 7.8 GB Huginn publication took 19-25 s beside a checkpoint write, 6.8 s alone).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()
_LANE = threading.local()  # which pool this thread's work goes to


def workers() -> int:
    """Threads to use: the CPUs this process may run on, or fewer where its backend gave the stage
    fewer (``$HOBSON_CPUS``: the local backend sets no affinity), at most 16 (past that, memory
    bandwidth)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    given = os.environ.get("HOBSON_CPUS", "")
    if given.isdigit() and int(given) > 0:
        n = min(n, int(given))
    return max(1, min(16, n))


def pool() -> ThreadPoolExecutor:
    """The calling thread's pool: the foreground one, or inside :func:`background` the background one."""
    lane = getattr(_LANE, "name", "foreground")
    with _LOCK:
        if lane not in _POOLS:
            # the background gets half the threads: the memory bandwidth is what both share
            n = workers() if lane == "foreground" else max(1, workers() // 2)
            _POOLS[lane] = ThreadPoolExecutor(n, thread_name_prefix=f"hobson-{lane}")
        return _POOLS[lane]


@contextlib.contextmanager
def background() -> Iterator[None]:
    """Inside the block, this thread's byte work goes to the background pool."""
    before = getattr(_LANE, "name", "foreground")
    _LANE.name = "background"
    try:
        yield
    finally:
        _LANE.name = before
