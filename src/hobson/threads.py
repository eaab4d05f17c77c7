"""torch's intra-op thread count: set once, in one place.

Results depend on it (intra-op reductions split by thread count), so a stage sets it before it
builds anything, from its ``--threads`` flag or the ``HOBSON_CPUS`` its backend exports (the CPUs
it was given); :func:`threads` holds a count for a block and puts the caller's back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def set_threads(threads: int | None = None) -> int | None:
    """Use ``threads``, else ``$HOBSON_CPUS``, else leave torch's default; returns the count set."""
    import torch

    if threads is None and os.environ.get("HOBSON_CPUS"):
        threads = int(os.environ["HOBSON_CPUS"])
    if threads:
        torch.set_num_threads(threads)
    return threads or None


def set_threads_before_torch(threads: int) -> None:
    """``threads`` for torch in this process, without importing torch for it.

    torch imported already: set now. Else the thread variables say it (``OMP_NUM_THREADS`` and
    ``MKL_NUM_THREADS``, which torch reads when it starts, and ``HOBSON_CPUS`` for
    :func:`set_threads`), so a process that imports torch later starts with that count and one
    that never does (a data stage) does not pay torch's ~3 s import.
    """
    import sys

    if "torch" in sys.modules:
        set_threads(threads)
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HOBSON_CPUS"):
        os.environ[var] = str(threads)


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """``n`` threads inside the block (None: unchanged), the caller's count after it."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
