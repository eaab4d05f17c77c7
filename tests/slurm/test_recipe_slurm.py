"""The recipe on the project's real local Slurm cluster: arrays, dependencies, status, retry, cancel."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hobson.io import sha256_file
from hobson.records import RunPaths
from launch.backends.slurm import SlurmBackend
from tests.conftest import REPO, run_cli

STAGES = ("build", "multistep", "teacher")


def submit(run_dir: Path, *stages: str, ngpu: int = 2, env: dict | None = None) -> dict:
    run_cli("recipe", *stages, "--backend", "slurm", "--ngpu", str(ngpu), "--run-dir", str(run_dir),
            "--logs-dir", str(run_dir.parent / "logs"), env=env)
    return json.loads((run_dir / "run.json").read_text())


def job_ids(meta: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in meta["submissions"]:
        out.setdefault(s["job"], []).append(s["job_id"])
    return out


def wait_all(slurm_jobs, meta: dict, deadline_s: float = 420, ids: list[str] | None = None) -> dict[str, str]:
    ids = ids or [i for v in job_ids(meta).values() for i in v]
    return {r["JobID"]: r["State"].split()[0] for r in slurm_jobs.wait(*ids, deadline_s=deadline_s)}


@pytest.fixture(scope="module")
def one_process_teacher(tmp_path_factory) -> str:
    """sha256 of the teacher file one process writes for the default corpus (the reference)."""
    d = tmp_path_factory.mktemp("ref")
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'src'}"}
    subprocess.run([sys.executable, "-m", "jobs.multistep", "--data-dir", str(d / "data")], cwd=REPO, check=True,
                   env=env, capture_output=True)
    subprocess.run([sys.executable, "-m", "jobs.teacher", "--corpus", str(d / "data/multistep/train.jsonl"),
                    "--out", str(d / "teacher.jsonl"), "--default-teacher-dir", str(d / "models/teacher"),
                    "--max-batch-tokens", "4096", "--max-batch-rows", "64", "--threads", "2"],
                   cwd=REPO, check=True, env=env, capture_output=True)
    return sha256_file(d / "teacher.jsonl")


def test_stages_run_as_jobs_with_arrays_and_afterok(tmp_path, slurm_jobs, one_process_teacher):
    run_dir = tmp_path / "run"
    meta = submit(run_dir, *STAGES)
    ids = job_ids(meta)
    assert sorted(ids) == ["build", "multistep", "teacher", "teacher-merge"]
    assert len({i for v in ids.values() for i in v}) == 4, "each stage is its own job"
    states = wait_all(slurm_jobs, meta)
    assert set(states.values()) == {"COMPLETED"}, states

    # teacher ran as a 2-task array, one (fake) GPU per task
    rows = slurm_jobs.sacct([ids["teacher"][0]], fields=("JobID", "State", "AllocTRES"))
    tasks = {r["JobID"]: r for r in rows if re.fullmatch(rf"{ids['teacher'][0]}_\d+", r["JobID"])}
    assert sorted(tasks) == [f"{ids['teacher'][0]}_0", f"{ids['teacher'][0]}_1"]
    assert all("gres/gpu=1" in r["AllocTRES"] for r in tasks.values())

    # what was submitted is exactly what the dry-run renders, with real ids for the placeholders
    paths = RunPaths.attach(run_dir)
    by_job = {s["job"]: s for s in meta["submissions"]}
    merge_script = Path(by_job["teacher-merge"]["script"]).read_text()
    assert f"#SBATCH --dependency=afterok:{ids['teacher'][0]}:{ids['build'][0]}" in merge_script
    assert "#SBATCH --kill-on-invalid-dep=yes" in merge_script
    dry = run_cli("recipe", *STAGES, "--backend", "slurm", "--ngpu", "2", "--dry-run", "--run-dir",
                  str(tmp_path / "dry"), "--logs-dir", str(tmp_path / "logs")).stdout
    for name, sub in by_job.items():
        rendered = dry.split(f": {name} (stage")[1].split("# sbatch --parsable <script below>\n", 1)[1]
        rendered = rendered.split("\n# ===== job ")[0]
        rendered = (rendered.replace(str((tmp_path / "logs" / "dry").resolve()), str(paths.logs_dir))
                    .replace(str((tmp_path / "dry").resolve()), str(paths.run_dir))
                    .replace("hobson-dry-", "hobson-run-"))
        for dep, dep_ids in ids.items():
            rendered = rendered.replace(f"{{job:{dep}}}", dep_ids[0])
        assert Path(sub["script"]).read_text() == rendered.rstrip("\n") + "\n", name

    assert sha256_file(run_dir / "labels/teacher.jsonl") == one_process_teacher
    out = run_cli("status", str(run_dir)).stdout
    assert "state from sacct+squeue" in out
    assert re.search(rf"teacher-merge\s+{ids['teacher-merge'][0]}\s+-\s+ok", out)


def test_failed_task_blocks_the_merge_and_retry_reruns_only_it(tmp_path, slurm_jobs, one_process_teacher):
    run_dir = tmp_path / "run"
    meta = submit(run_dir, *STAGES, env={"HOBSON_TEST_FAIL": "teacher:1"})
    ids = job_ids(meta)
    states = wait_all(slurm_jobs, meta)
    assert states[f"{ids['teacher'][0]}_1"] == "FAILED" and states[f"{ids['teacher'][0]}_0"] == "COMPLETED"
    assert states[ids["teacher-merge"][0]] == "CANCELLED"  # --kill-on-invalid-dep=yes
    assert not (run_dir / "labels/teacher.jsonl").exists()
    out = run_cli("status", str(run_dir)).stdout
    assert "failed or cancelled: teacher shard 1, teacher-merge" in out

    run_cli("retry", str(run_dir))
    meta = json.loads((run_dir / "run.json").read_text())
    new = meta["submissions"][len(ids) + 0:]
    assert [(s["job"], s.get("shards"), s.get("tasks")) for s in new] == [("teacher", "1", 1),
                                                                          ("teacher-merge", None, None)]
    assert "#SBATCH --array=0-0%1" in Path(new[0]["script"]).read_text()
    states = wait_all(slurm_jobs, meta, deadline_s=300, ids=[s["job_id"] for s in new])
    assert set(states.values()) == {"COMPLETED"}, states
    assert sha256_file(run_dir / "labels/teacher.jsonl") == one_process_teacher
    assert "failed or cancelled" not in run_cli("status", str(run_dir)).stdout


def test_cancelled_job_shows_in_one_poll_also_without_accounting(tmp_path, slurm_jobs):
    run_dir = tmp_path / "run"
    meta = submit(run_dir, *STAGES)
    ids = job_ids(meta)
    slurm_jobs.run(["scancel", ids["teacher"][0]])
    out = run_cli("status", str(run_dir)).stdout
    assert re.search(r"teacher\s+\d+\s+\d\s+CANCELLED", out), out
    out = run_cli("cancel", str(run_dir)).stdout
    assert "cancelled jobs" in out
    wait_all(slurm_jobs, meta, deadline_s=60)

    dbd = REPO / "tests/cluster/dbd.sh"
    subprocess.run(["bash", str(dbd), "stop"], check=True, capture_output=True)
    try:
        t0 = time.monotonic()
        out = run_cli("status", str(run_dir)).stdout
        assert time.monotonic() - t0 < 30
        assert "state from squeue" in out
        assert re.search(r"teacher\s+\d+\s+\d\s+CANCELLED", out), out
    finally:
        subprocess.run(["bash", str(dbd), "start"], check=True, capture_output=True)


def test_status_falls_back_to_the_record_when_slurm_does_not_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sacct, no squeue: a login node without clients
    assert SlurmBackend.query(["1", "2"]) == ("record", {})
