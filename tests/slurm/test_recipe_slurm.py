"""The recipe on the project's real local Slurm cluster: arrays, dependencies, status, retry, cancel."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hobson import faults
from hobson.io import sha256_file
from hobson.launch.backends.slurm import SlurmBackend
from hobson.records import RunPaths
from tests.conftest import REPO, run_cli

STAGES = ("build", "multistep", "teacher")


def submit(run_dir: Path, *stages: str, ngpu: int = 2, env: dict | None = None, args: Sequence[str] = ()) -> dict:
    """`recipe STAGES --backend slurm` (``args``: more launcher flags); the run record it wrote."""
    run_cli("recipe", *stages, "--backend", "slurm", "--ngpu", str(ngpu), "--run-dir", str(run_dir),
            "--logs-dir", str(run_dir.parent / "logs"), *args, env=env)
    return json.loads((run_dir / "run.json").read_text())


def job_ids(meta: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in meta["submissions"]:
        if "job_id" in s:  # a run continued from a local one also lists its local (id-less) submissions
            out.setdefault(s["job"], []).append(s["job_id"])
    return out


def wait_all(slurm_jobs, meta: dict, deadline_s: float = 420, ids: list[str] | None = None) -> dict[str, str]:
    ids = ids or [i for v in job_ids(meta).values() for i in v]
    return {r["JobID"]: r["State"].split()[0] for r in slurm_jobs.wait(*ids, deadline_s=deadline_s)}


SAME_BYTES = ["labels/teacher.jsonl", "labels/teacher_train.jsonl", "labels/replay.jsonl", "labels/final_teacher.jsonl",
              "parent/final/adapter.safetensors", "parent/final/head.safetensors",
              "train/final/adapter.safetensors", "train/final/head.safetensors",
              "calibrated/temperatures.json", "eval/predictions.jsonl"]


@pytest.mark.slow
def test_recipe_all_on_slurm_equals_the_local_run(tmp_path, slurm_jobs, recipe_all_local):
    """Slow: every stage of the recipe runs as Slurm jobs (arrays, torchrun) on the local cluster."""
    local_dir, _, _ = recipe_all_local
    run_dir = tmp_path / "run"
    meta = submit(run_dir, "all")
    ids = job_ids(meta)
    assert len(ids) == 15 and all(len(v) == 1 for v in ids.values())
    assert len({v[0] for v in ids.values()}) == 15, "each stage is its own job"
    states = wait_all(slurm_jobs, meta, deadline_s=1500)
    assert set(states.values()) == {"COMPLETED"}, states

    # labelling ran as 2-task arrays on one (fake) GPU each; training held both GPUs
    for array in ("teacher", "replay"):
        rows = slurm_jobs.sacct([ids[array][0]], fields=("JobID", "State", "AllocTRES"))
        tasks = {r["JobID"]: r for r in rows if re.fullmatch(rf"{ids[array][0]}_\d+", r["JobID"])}
        assert sorted(tasks) == [f"{ids[array][0]}_0", f"{ids[array][0]}_1"]
        assert all("gres/gpu=1" in r["AllocTRES"] for r in tasks.values())
    for torchrun in ("parent", "train"):
        (row,) = slurm_jobs.sacct([ids[torchrun][0]], fields=("JobID", "State", "AllocTRES"))
        assert "gres/gpu=2" in row["AllocTRES"], row

    # what was submitted is exactly what the dry-run renders, with real ids for the placeholders
    paths = RunPaths.attach(run_dir)
    by_job = {s["job"]: s for s in meta["submissions"]}
    for array in ("teacher", "replay"):
        script = Path(by_job[f"{array}-merge"]["script"]).read_text()
        assert re.search(rf"#SBATCH --dependency=afterok:{ids[array][0]}(:|$)", script, re.M)
        assert "#SBATCH --kill-on-invalid-dep=yes" in script
    dry = run_cli("recipe", "all", "--backend", "slurm", "--ngpu", "2", "--dry-run", "--run-dir",
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

    # the same bytes as the local backend
    for rel in SAME_BYTES:
        assert sha256_file(run_dir / rel) == sha256_file(local_dir / rel), rel
    out = run_cli("status", str(run_dir)).stdout
    assert "state from sacct+squeue" in out
    assert re.search(rf"train\s+{ids['train'][0]}\s+-\s+ok", out)


@pytest.mark.slow
def test_failed_task_blocks_the_merge_and_retry_reruns_only_it(tmp_path, slurm_jobs, recipe_all_local):
    """Slow: the recipe's stages up to the teacher merge run as Slurm jobs, twice."""
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
    assert sha256_file(run_dir / "labels/teacher.jsonl") == sha256_file(recipe_all_local[0] / "labels/teacher.jsonl")
    out = run_cli("status", str(run_dir)).stdout
    assert "failed or cancelled" not in out
    # every shard shows after the retry: shard 0 from the first attempt, shard 1 from the retry
    shards = {line.split()[2]: line for line in out.splitlines() if line.startswith("teacher ")}
    assert set(shards) == {"0", "1"}, out
    assert ids["teacher"][0] in shards["0"] and new[0]["job_id"] in shards["1"], out


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


def _steps(log: Path) -> list[int]:
    steps = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"step"' in line and '"loss"' in line:
            steps.append(json.loads(line)["step"])
    return steps


@pytest.mark.slow
def test_training_sent_usr2_checkpoints_requeues_and_ends_with_the_same_weights(tmp_path, slurm_jobs, tiny_training):
    """A torchrun training job (3 steps, no periodic checkpoint) is preempted before step 2,
    requeued by slurmctld and run again from the checkpoint USR2 wrote.
    Slow: the requeued job waits ~11 s (cred_expire) before it starts again."""
    run_dir = tiny_training.copy_inputs(tmp_path / "run")
    config = tiny_training.write_config("train", tmp_path / "train.yaml", checkpoint_every=0)
    holds = tmp_path / "holds"
    meta = submit(run_dir, "train", env={faults.ENV_POINTS: "train-step-2", faults.ENV_DIR: str(holds)},
                  args=["--train-config", str(config)])
    (job,) = job_ids(meta)["train"]
    log = tmp_path / "logs" / "run" / "train.log"
    # the ranks hold before step 2 until the USR2 reaches them, whatever the machine's speed
    faults.wait_held(holds, "train-step-2", 600, alive=lambda: bool(slurm_jobs.active([job])))
    slurm_jobs.run(["scancel", "--signal=USR2", "--batch", job])
    states = wait_all(slurm_jobs, meta, deadline_s=900)
    assert states[job] == "COMPLETED", states

    first, second = _steps(log), _steps(tmp_path / "logs" / "run" / "train.attempt1.log")
    assert "[hobson] checkpointed after USR2: requeue" in log.read_text()
    # USR2 checkpoints at the step boundary it lands on, so no step runs twice
    assert (first, second) == ([1, 2], list(range(3, tiny_training.steps + 1))), (first, second)
    for rel in ("adapter.safetensors", "head.safetensors"):
        assert sha256_file(run_dir / "train/final" / rel) == sha256_file(tiny_training.two_ranks["train"] / rel), rel


def test_arrays_longer_than_max_array_size_are_split_and_the_merge_waits_for_all(tmp_path, monkeypatch,
                                                                                 slurm_jobs):
    """MaxArraySize is read from `scontrol show config`; here it is lowered for this backend object only
    (the cluster's own limit is exercised by bench/submit.py), and the jobs are submitted held."""
    from hobson.launch import dag
    from hobson.launch.backends import slurm
    from hobson.launch.options import ClusterProfile, RecipeConfig
    from hobson.records import new_run_json, write_run_json

    monkeypatch.setattr(slurm, "max_array_size", lambda: 3)
    cfg = RecipeConfig()
    cfg.teacher.shards = 8
    paths = RunPaths.create(tmp_path / "run", tmp_path / "logs")
    paths.run_dir.mkdir(parents=True)
    write_run_json(paths, new_run_json(paths, argv=["test"], backend="slurm", options={}, config_digests={}))
    ctx = dag.PlanContext(run_dir=str(paths.run_dir), ngpu=2, config=cfg, seed=0, expected_rows=lambda rel: None)
    jobs = [j for j in dag.plan(["teacher"], ctx, lambda rel: None) if j.stage == "teacher"]
    backend = SlurmBackend(ClusterProfile(extra_sbatch=["--hold"]), ngpu=2)
    ids = backend.submit(jobs, paths, echo=lambda s: None)
    try:
        assert len(ids["teacher"]) == 3
        meta = json.loads(paths.run_json.read_text())
        parts = [s for s in meta["submissions"] if s["job"] == "teacher"]
        assert [s["shards"] for s in parts] == ["0-2", "3-5", "6-7"]
        scripts = [Path(s["script"]).read_text() for s in parts]
        assert ["#SBATCH --array=0-2%2" in scripts[0], "#SBATCH --array=0-2%2" in scripts[1],
                "#SBATCH --array=0-1%2" in scripts[2]] == [True] * 3
        merge = Path(next(s for s in meta["submissions"] if s["job"] == "teacher-merge")["script"]).read_text()
        assert f"#SBATCH --dependency=afterok:{':'.join(ids['teacher'])}" in merge
        states = slurm_jobs.records(ids["teacher"] + ids["teacher-merge"])
        assert states and all(st == "PENDING" for st in states.values()), states
    finally:
        slurm_jobs.run(["scancel", *ids["teacher"], *ids["teacher-merge"]])


def test_a_refused_submission_takes_back_the_jobs_already_submitted(tmp_path, slurm_jobs):
    """The cluster's nodes have 64,000 MB: a stage asking for more is refused by sbatch itself."""
    run_dir = tmp_path / "run"
    profile = tmp_path / "big.yaml"
    profile.write_text("stages:\n  multistep: {mem_gb: 500}\n")
    proc = run_cli("recipe", "build", "multistep", "--backend", "slurm", "--run-dir", str(run_dir),
                   "--logs-dir", str(tmp_path / "logs"), "--cluster", str(profile), check=False)
    assert proc.returncode == 2
    assert "sbatch refused job multistep" in proc.stderr and "cancelled the jobs already submitted" in proc.stderr
    (build_id,) = [s["job_id"] for s in json.loads((run_dir / "run.json").read_text())["submissions"]]
    states = wait_all(slurm_jobs, {}, deadline_s=60, ids=[build_id])
    assert states[build_id] in ("CANCELLED", "COMPLETED"), states


def test_shipped_recipe_script_runs_the_stages_in_one_allocation(tmp_path, slurm_jobs, recipe_all_local):
    """`sbatch sbatch/recipe.sh` as its usage says (resources overridden on the command line, the
    stages and run directory from the environment): one job holding two GPUs runs the stages on the
    local backend, each teacher shard on its own GPU, and the merged labels equal the local run's."""
    import sys

    local_dir, _, _ = recipe_all_local
    run_dir = tmp_path / "run"
    log = tmp_path / "recipe-%j.log"
    env = {"STAGES": "build multistep teacher", "RUN_DIR": str(run_dir), "PYTHON": sys.executable}
    out = slurm_jobs.run(["sbatch", "--parsable", "--gpus-per-node=2", "--cpus-per-task=2", "--mem=4G",
                          f"--output={log}", "sbatch/recipe.sh"], env=env, cwd=REPO).stdout
    job_id = out.strip().split(";")[0]
    slurm_jobs.submitted.append(job_id)
    (row,) = slurm_jobs.wait(job_id, deadline_s=600, fields=("JobID", "State", "AllocTRES"))
    text = Path(str(log).replace("%j", job_id)).read_text()
    assert row["State"] == "COMPLETED", text[-3000:]
    assert "gres/gpu=2" in row["AllocTRES"], row
    meta = json.loads((run_dir / "run.json").read_text())
    assert {s["job"] for s in meta["submissions"]} >= set(STAGES)
    teacher = [s for s in meta["submissions"] if s["job"] == "teacher"]
    assert teacher and teacher[-1]["tasks"] == 2, teacher  # NGPU from the job's CUDA_VISIBLE_DEVICES
    assert sha256_file(run_dir / "labels" / "teacher.jsonl") == sha256_file(local_dir / "labels" / "teacher.jsonl")
