"""The stage wrapper itself: a stage stopped by SIGTERM (scancel, a time limit) is recorded and
leaves no half-written output."""

from __future__ import annotations

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
