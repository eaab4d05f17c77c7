"""One launcher per run: a second ``recipe``, ``rl`` or ``retry`` on a run being launched is refused.

The lock is an ``flock`` on ``<run_dir>/launcher.lock``, held for as long as the launcher runs the
run's jobs (the local backend) or submits them (Slurm, AWS). The kernel releases an flock when its
process dies, SIGKILL included, so the lock of a dead launcher is simply taken over; the file
keeps the holder's pid, host, start time and command for the refusal message. A run whose Slurm
jobs are still queued or running is refused too (from its record and one scheduler query).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator

from hobson.errors import HobsonError
from hobson.records import RunPaths, utc_now

LOCK = "launcher.lock"
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD"}


@contextlib.contextmanager
def launcher_lock(paths: RunPaths, what: str) -> Iterator[None]:
    """Hold the run's launcher lock for the block; a live holder makes this one HobsonError."""
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    path = paths.run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise HobsonError(
                f"run {paths.run_dir.name} is already being launched by pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} since {holder.get('started_utc', '?')} "
                f"({' '.join(holder.get('command', [])) or 'command unknown'}); wait for it to end, or stop it "
                f"(python launch/submit.py cancel {paths.run_dir}), then {what} again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_utc": utc_now(),
                                   "command": sys.argv, "what": what}) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}


def refuse_if_jobs_active(paths: RunPaths, states: dict[str, dict[str, str]], what: str) -> None:
    """A run whose scheduler jobs are still queued or running is not launched again."""
    active = sorted(j for j, f in states.items() if (f.get("state") or "").split(" ")[0] in ACTIVE)
    if active:
        raise HobsonError(f"run {paths.run_dir.name} has jobs queued or running ({', '.join(active)}); wait for "
                          f"them, or cancel them (python launch/submit.py cancel {paths.run_dir}), then {what} again")
