"""TEST-ONLY fault points: a run holds at a named point until a test releases it.

A fault test must land its fault at a known moment of the run, never "soon after a checkpoint
appeared": on an idle machine a tiny run can finish before the fault arrives. With

    HOBSON_TEST_HOLD=update-2[,train-step-3] HOBSON_TEST_HOLD_DIR=/some/dir

a process reaching :func:`hold` at ``update-2`` writes ``DIR/update-2.held.<pid>`` (holding its
pid) and waits until ``DIR/update-2.release`` exists; a point already released does not hold
again (a requeued or resumed job passes straight through). While it waits, signals are handled
as usual, so a test can kill the process, SIGSTOP its peer, or send USR2 at exactly that point,
then release it (or let ``until`` end the hold). Without the variables :func:`hold` does nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ENV_POINTS = "HOBSON_TEST_HOLD"
ENV_DIR = "HOBSON_TEST_HOLD_DIR"
POLL_S = 0.02


def _points() -> set[str]:
    return set(filter(None, os.environ.get(ENV_POINTS, "").split(",")))


def armed(point: str) -> bool:
    """Would :func:`hold` wait at ``point``? (configured and not yet released)"""
    root = os.environ.get(ENV_DIR)
    return bool(root) and point in _points() and not (Path(root) / f"{point}.release").exists()


def fire_once(point: str) -> bool:
    """True the first time a configured ``point`` is reached (a damage test's fault, e.g. one
    weight bucket corrupted in flight); it then counts as released, so a retry goes through."""
    if not armed(point):
        return False
    release(os.environ[ENV_DIR], point)
    print(f"[hobson] HOBSON_TEST_HOLD: fault {point} fired (pid {os.getpid()})", flush=True)
    return True


def hold(point: str, settle: Callable[[], object] | None = None, until: Callable[[], bool] | None = None) -> None:
    """Wait at ``point`` until a test releases it or ``until()`` turns true (e.g. "a USR2 has
    arrived": the signal the test sends at this point is then handled before the run goes on).
    ``settle`` runs first (e.g. let a background checkpoint finish, so that the state at the point
    does not depend on the machine's speed)."""
    if not armed(point):
        return
    if settle is not None:
        settle()
    root = Path(os.environ[ENV_DIR])
    root.mkdir(parents=True, exist_ok=True)
    marker = root / f"{point}.held.{os.getpid()}"
    tmp = root / f".{marker.name}.tmp"
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, marker)  # whole when seen
    # one write, not print()'s two: every rank of a torchrun job writes to the same log
    sys.stdout.write(f"[hobson] HOBSON_TEST_HOLD: holding at {point} (pid {os.getpid()})\n")
    sys.stdout.flush()
    release = root / f"{point}.release"
    while not release.exists() and not (until is not None and until()):
        time.sleep(POLL_S)


def wait_held(root: str | os.PathLike, point: str, timeout_s: float, alive: Callable[[], bool] | None = None) -> int:
    """For tests: wait until a process holds at ``point``; returns its pid. ``alive`` (e.g. "the
    job is still queued or running") turns a run that died before the point into a quick failure."""
    end = time.monotonic() + timeout_s
    while True:
        found = sorted(Path(root).glob(f"{point}.held.*")) if Path(root).is_dir() else []
        if found:
            return int(found[0].read_text().strip())
        if time.monotonic() > end:
            raise TimeoutError(f"nothing held at {point} within {timeout_s:.0f} s")
        if alive is not None and not alive():
            raise RuntimeError(f"the run ended before it reached {point}")
        time.sleep(0.1)


def held_pids(root: str | os.PathLike, point: str) -> list[int]:
    """For tests: the pids of every process holding (or that held) at ``point``, e.g. all ranks."""
    found = sorted(Path(root).glob(f"{point}.held.*")) if Path(root).is_dir() else []
    return [int(p.read_text().strip()) for p in found]


def release(root: str | os.PathLike, point: str) -> None:
    """For tests: let every process holding at ``point`` (and any that reach it later) go on."""
    Path(root).mkdir(parents=True, exist_ok=True)
    (Path(root) / f"{point}.release").touch()
