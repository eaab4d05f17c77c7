"""One process-wide thread pool for byte work that frees the GIL (hashing, pread/pwrite, copies).

hashlib releases the GIL for buffers over 2 KiB, os.pread/os.pwrite around the system call and
torch around a CUDA stream synchronize, so threads run such work on as many cores as they have:
on a 16-core GPU host a 35 GB checkpoint hashes in seconds rather than the ~20 s of one core.
The pool is shared, not made per call, so concurrent users (the background checkpoint thread and
a verifier) never hold more than one set of threads between them.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOL: ThreadPoolExecutor | None = None
_LOCK = threading.Lock()


def workers() -> int:
    """Threads to use: the CPUs this process may run on, at most 16 (past that, memory bandwidth)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(workers(), thread_name_prefix="hobson-bytes")
        return _POOL
