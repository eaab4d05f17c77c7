"""Workers that end with the process that started them (Linux ``PR_SET_PDEATHSIG``).

The local backend starts each stage in its own session (so its process group can be signalled
as one) and a stage started under torchrun starts torchrun; were their parent killed, SIGKILL
included, they would run on unwatched and unrecorded. :func:`die_with_parent`, run in the child
between fork and exec (``preexec_fn``), asks the kernel to send it SIGTERM when its parent dies:
a stage then records itself as terminated, and torchrun stops its ranks.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, *, new_session: bool = True) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies;
    ``new_session`` also starts it in a session of its own (what ``start_new_session=True`` does)."""
    parent = os.getpid()

    def preexec() -> None:
        if new_session:
            os.setsid()
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: nothing to ask for
            return
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)

    return preexec
