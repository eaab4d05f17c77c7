"""hobson.faults: a process holds at a named point until released, and passes a released point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hobson import faults

HOLDER = "from hobson import faults; faults.hold('p'); print('past p', flush=True)"


def test_nothing_holds_without_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV_POINTS, raising=False)
    assert not faults.armed("p")
    faults.hold("p")  # returns at once


def test_a_process_holds_until_released_then_a_released_point_passes(tmp_path, monkeypatch) -> None:
    env = {**os.environ, faults.ENV_POINTS: "p,q", faults.ENV_DIR: str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        pid = faults.wait_held(tmp_path, "p", 120, alive=lambda: proc.poll() is None)
        assert pid == proc.pid and proc.poll() is None  # it waits, held
        faults.release(tmp_path, "p")
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.endswith("past p\n")
    again = subprocess.run([sys.executable, "-c", HOLDER], env=env, capture_output=True, text=True, timeout=120)
    assert again.stdout.endswith("past p\n")  # a requeued or resumed run passes straight through
    monkeypatch.setenv(faults.ENV_POINTS, "p,q")
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path))
    assert not faults.armed("p") and faults.armed("q") and not faults.armed("r")


def test_until_ends_a_hold_and_settle_runs_first(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV_POINTS, "q")
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path))
    calls: list[str] = []
    faults.hold("q", settle=lambda: calls.append("settle"), until=lambda: calls.append("until") is None)
    assert calls == ["settle", "until"]
    assert [p.name.split(".")[0] for p in tmp_path.glob("q.held.*")] == ["q"]


def test_a_run_that_ends_before_the_point_fails_the_wait_at_once(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="ended before it reached p"):
        faults.wait_held(tmp_path, "p", 120, alive=lambda: False)
