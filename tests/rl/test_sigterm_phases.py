"""SIGTERM at each phase of an RL run, then ``--resume``: the uninterrupted result, its final record
and plot (hobson.faults holds the run at the phase; the signal lands there, whatever the speed).

Phases of update 2 of 3: after its rollout (``train-2``), after its optimizer steps
(``publish-2``), after its publication (``checkpoint-2``), while its checkpoint may still be being
written in the background (``log-2``) and with checkpoints written in line, and after the last
update before the final record (``finish``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hobson import faults
from hobson.rl.verify_resume import compare_runs

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--algorithm", "ppo", "--updates", "3", "--max-new-tokens", "4", "--prompts-per-update", "2",
        "--completions-per-prompt", "2", "--trainer", "torch", "--device", "cpu"]
PHASES = [("train-2", ()), ("publish-2", ()), ("checkpoint-2", ()), ("log-2", ()),
          ("log-2", ("--checkpoint-in-line",)), ("finish", ())]


def _rl(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    # one torch thread, as the reference: a resume checks the count (rollout bits depend on it)
    return subprocess.Popen([sys.executable, "-m", "jobs.rl", *args], cwd=REPO, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[tuple, Path]:
    """The uninterrupted runs (background and in-line checkpoints), cached by extra flags."""
    root = tmp_path_factory.mktemp("sigterm-ref")
    done: dict[tuple, Path] = {}

    def get(extra: tuple) -> Path:
        if extra not in done:
            out = root / f"ref{len(done)}"
            p = _rl([*ARGS, *extra, "--output", str(out)])
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            done[extra] = out
        return done[extra]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("phase,extra", PHASES, ids=[f"{p}{'-inline' if e else ''}" for p, e in PHASES])
def test_sigterm_at_a_phase_then_resume_gives_the_uninterrupted_run(reference, tmp_path, phase, extra):
    """Each case: two short RL processes (about 10 s); slow because there are six phases."""
    ref = reference(extra)
    out, holds = tmp_path / "run", tmp_path / "holds"
    p = _rl([*ARGS, *extra, "--output", str(out)], {faults.ENV_POINTS: phase, faults.ENV_DIR: str(holds)})
    faults.wait_held(holds, phase, 300, alive=lambda: p.poll() is None)
    os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-3000:]
    assert not [x for x in out.rglob(".*")], "a temporary directory was left behind"
    session = json.loads((out / "run.json").read_text())["rl"]["sessions"][-1]
    assert "finished_utc" not in session and not (out / "metrics.png").exists()
    again = _rl([*ARGS, *extra, "--output", str(out), "--resume"])
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    diffs = [i.line() for i in compare_runs(ref, out) if i.difference]
    assert diffs == [], diffs
    assert json.loads((out / "run.json").read_text())["rl"]["sessions"][-1].get("finished_utc")
    assert (out / "metrics.png").is_file()
    if phase == "finish":  # now finished: a further resume has nothing to do
        done = _rl([*ARGS, *extra, "--output", str(out), "--resume"])
        _, err = done.communicate(timeout=300)
        assert done.returncode == 1 and "the run already finished all 3 updates" in err, err[-3000:]


def test_checkpoint_every_k_then_a_resume_replays_from_the_newest_bit_for_bit(tmp_path):
    """`--checkpoint-every 2` over 4 updates: checkpoints exist for updates 2 and 4 only (the
    settings decide, never timing). A run stopped by SIGTERM before update 4 (update 3 done, not
    checkpointed) resumes from checkpoint 2, replays update 3 and ends with the uninterrupted run."""
    args = [*ARGS[:2], "--updates", "4", *ARGS[4:], "--checkpoint-every", "2"]
    ref = tmp_path / "ref"
    p = _rl([*args, "--output", str(ref)])
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert sorted(c.name for c in (ref / "checkpoints").iterdir()) == ["update-000002", "update-000004"]
    out, holds = tmp_path / "run", tmp_path / "holds"
    p = _rl([*args, "--output", str(out)], {faults.ENV_POINTS: "update-4", faults.ENV_DIR: str(holds)})
    faults.wait_held(holds, "update-4", 300, alive=lambda: p.poll() is None)
    os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-3000:]
    assert sorted(c.name for c in (out / "checkpoints").iterdir()) == ["update-000002"]
    again = _rl([*args, "--output", str(out), "--resume"])
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    sessions = json.loads((out / "run.json").read_text())["rl"]["sessions"]
    assert [s["updates_run"] for s in sessions] == [[1, 2, 3], [3, 4]]
    assert sessions[1]["resumed_from"] == "checkpoints/update-000002"
    diffs = [i.line() for i in compare_runs(ref, out) if i.difference]
    assert diffs == [], diffs
