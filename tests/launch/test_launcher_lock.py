"""One launcher per run (hobson.launch.lock): a second `recipe` or `retry` on a run whose launcher
is alive is refused naming it; the lock of a launcher killed with SIGKILL is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hobson import faults
from tests.conftest import REPO, run_cli


def _gone(pid: int, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < end, f"pid {pid} still alive"
        time.sleep(0.05)


def _held_launcher(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int, list[str]]:
    """``(launcher, stage pid, its argv)``: `recipe build` on the local backend, its stage held at its start."""
    run_dir, holds = tmp_path / "run", tmp_path / "holds"
    argv = ["recipe", "build", "--backend", "local", "--run-dir", str(run_dir), "--logs-dir", str(tmp_path / "logs")]
    env = {**env, faults.ENV_POINTS: "stage-build", faults.ENV_DIR: str(holds)}
    launcher = subprocess.Popen([sys.executable, str(REPO / "launch" / "submit.py"), *argv], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stage = faults.wait_held(holds, "stage-build", 300, alive=lambda: launcher.poll() is None)
    return launcher, stage, argv


def test_a_second_launcher_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path, subprocess_env):
    first, stage, argv = _held_launcher(tmp_path, subprocess_env)
    for cmd in (argv, ["retry", str(tmp_path / "run")]):
        second = run_cli(*cmd, check=False)
        assert second.returncode == 2, second.stdout + second.stderr
        (line,) = [x for x in second.stderr.splitlines() if x.startswith("error:")]
        assert f"is already being launched by pid {first.pid} on " in line and "cancel" in line, line
    os.kill(first.pid, signal.SIGKILL)  # the kernel drops its lock with it (and ends its stage)
    first.communicate(timeout=60)
    _gone(stage)
    third = run_cli(*argv)
    assert "build" in third.stdout and third.returncode == 0


def test_a_local_stage_ends_when_its_launcher_is_killed(tmp_path, subprocess_env):
    """SIGKILL to the launcher while its stage runs (held at its start): the kernel sends the stage
    SIGTERM (hobson.lifetime), and status says the launcher is gone."""
    launcher, stage, _ = _held_launcher(tmp_path, subprocess_env)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.communicate(timeout=60)
    _gone(stage)  # no one else signals it: only the kernel's parent-death signal can end it
    status = run_cli("status", str(tmp_path / "run")).stdout
    assert "launcher" in status and "gone" in status, status
