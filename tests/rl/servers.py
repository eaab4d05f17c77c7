"""A rollout server in its own process on localhost, for the RL tests (fixtures: conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hobson.rollout.transport import wait_ready

REPO = Path(__file__).resolve().parents[2]


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def start_server(addr: Path, **env: str) -> subprocess.Popen[str]:
    """``python -m jobs.rollout_server`` on 127.0.0.1, ready (answering a ping) when returned."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.rollout_server", "--address-file", str(addr), "--advertise", "127.0.0.1"],
        cwd=REPO, env=server_env(**env), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    wait_ready(addr, 60, watch_pid=proc.pid)
    return proc


def stop_server(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)




def start_servers(template: str, n: int, env: dict[int, dict[str, str]] | None = None) -> list[subprocess.Popen[str]]:
    """``n`` servers of one job (``{index}`` in ``template``), started together, each ready when
    returned; ``env[i]``: extra environment of server ``i``."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jobs.rollout_server", "--address-file", template, "--index", str(i),
             "--advertise", "127.0.0.1"],
            cwd=REPO, env=server_env(**(env or {}).get(i, {})), text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]
    for i, proc in enumerate(procs):
        wait_ready(template.replace("{index}", str(i)), 60, watch_pid=proc.pid)
    return procs
