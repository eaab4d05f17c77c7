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
