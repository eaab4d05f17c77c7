"""The stage wrapper itself: a stage stopped by SIGTERM (scancel, a time limit) is recorded and
leaves no half-written output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hobson.records import RunPaths, read_stage_records

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_mid_write_records_the_stage_and_leaves_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "outputs" / "x.json"
    cmd = [sys.executable, "-m", "hobson.stagerun", "--run-dir", str(tmp_path), "--stage", "s",
           "--job", "tests.launch.sample_jobs", "--output", "outputs/x.json",
           "--", "--out", str(out), "--terminated-while-writing"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert "SIGTERM: stage stopped" in proc.stderr
    assert list(out.parent.iterdir()) == []  # neither the output nor its temporary
    (rec,) = read_stage_records(RunPaths(tmp_path, tmp_path))
    assert (rec["stage"], rec["status"], rec["exit_code"]) == ("s", "failed", 143)
    assert rec["error"] == "terminated by SIGTERM"


def test_stages_keep_tritons_autotuning_choices_unless_the_user_says_otherwise(tmp_path: Path) -> None:
    """Every stage runs with ``TRITON_CACHE_AUTOTUNING=1`` (the next process on the same GPU kind
    reuses the first's kernel choices instead of benchmarking them again); a value the user set
    reaches the job unchanged."""
    seen = {}
    for user in (None, "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_AUTOTUNING"}
        if user is not None:
            env["TRITON_CACHE_AUTOTUNING"] = user
        out = tmp_path / f"seen-{user}.json"
        cmd = [sys.executable, "-m", "hobson.stagerun", "--run-dir", str(tmp_path), "--stage", f"s{user}",
               "--job", "tests.launch.sample_jobs", "--", "--out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        seen[user] = json.loads(out.read_text())["triton_autotune_cache"]
    assert seen == {None: "1", "0": "0"}
