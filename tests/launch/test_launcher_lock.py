"""One launcher per run (hobson.launch.lock): a second `recipe` or `retry` on a run whose launcher
is alive is refused naming it; the lock of a launcher killed with SIGKILL is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_the_ranks_of_a_local_torchrun_stage_end_when_its_launcher_is_killed(tmp_path, subprocess_env,
                                                                            recipe_all_local):
    """`recipe train --ngpu 2` (torchrun, two ranks) in a copy of the finished local run, both
    ranks held before step 1: SIGKILL to the launcher ends the stage wrapper, torchrun and both
    ranks (the kernel's parent-death signals, then torchrun stopping its workers); nothing is
    left running and the rerun after it trains to the end.

    Slow (~30 s on 2 cores, after the session's `recipe all` fixture): two torchrun launches of
    the real training stage, the second training to the end."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(recipe_all_local[0], run, ignore=shutil.ignore_patterns("launcher.lock"))
    shutil.rmtree(run / "train")  # its outputs gone: `recipe train` runs the stage again
    holds = tmp_path / "holds"
    argv = ["recipe", "train", "--backend", "local", "--ngpu", "2", "--run-dir", str(run),
            "--logs-dir", str(tmp_path / "logs")]
    env = {**subprocess_env, faults.ENV_POINTS: "train-step-1", faults.ENV_DIR: str(holds)}
    launcher = subprocess.Popen([sys.executable, str(REPO / "launch" / "submit.py"), *argv], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + 300
    while len(ranks := sorted(holds.glob("train-step-1.held.*"))) < 2:
        assert launcher.poll() is None, launcher.communicate()[0]
        assert time.monotonic() < end, "the two ranks did not reach step 1"
        time.sleep(0.05)
    rank_pids = [int(p.read_text()) for p in ranks]
    tree = _descendants(launcher.pid)
    assert set(rank_pids) <= set(tree), (rank_pids, tree)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.communicate(timeout=60)
    for pid in tree:  # the wrapper, torchrun and both ranks: no one else signals them
        _gone(pid)
    faults.release(holds, "train-step-1")
    again = run_cli(*argv)
    assert again.returncode == 0 and (run / "train" / "final").is_dir(), again.stdout


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
