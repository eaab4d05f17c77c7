"""Faults on the project's own cluster: a node set DOWN under a running job, slurmctld stopped and
restarted mid-run.

Every test holds its run at a ``hobson.faults`` point (the stage's start, a training step, an RL
update), lands the fault there, then releases the run and compares its result byte for byte with
the uninterrupted one. ``sacct -D`` (every attempt of a requeued job) shows that the held task
really ran on the node set DOWN and that its next attempt ran elsewhere. The ``cluster_faults``
fixture puts back what a test took away (nodes DOWN, a stopped slurmctld) even when it fails.
The tests run one after another in this module: each takes nodes away from the others.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hobson import faults
from hobson.io import sha256_file
from tests.conftest import REPO, run_cli
from tests.slurm.test_recipe_slurm import job_ids, submit, wait_all
from tests.slurm.test_rl_slurm import (
    REQUEUE_DEADLINE_S,
    _assert_same,
    _env,
    _hold,
    _log,
    _submit,
    _wait_gone,
    _wait_held,
    reference,  # noqa: F401  (a fixture: the RL run's uninterrupted result)
)

CTLD_PID = Path("/run/hobson-cluster/slurmctld.pid")  # written by tests/cluster/up.sh
UP = REPO / "tests" / "cluster" / "up.sh"


class ClusterFaults:
    """Faults a test lands on the cluster, each undone by :meth:`restore`."""

    def __init__(self, jobs) -> None:
        self.jobs = jobs
        self.downed: list[str] = []
        self.ctld_stopped = False

    def down(self, node: str, why: str) -> None:
        self.downed.append(node)
        self.jobs.run(["scontrol", "update", f"nodename={node}", "state=down", f"reason=hobson test: {why}"])

    def stop_slurmctld(self) -> None:
        """SIGTERM to the slurmctld up.sh started; returns once it has exited (its state is on disk)."""
        pid = int(CTLD_PID.read_text().strip())
        self.ctld_stopped = True
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)

    def start_slurmctld(self) -> None:
        """up.sh starts the daemons that are not running and returns once every node answers."""
        subprocess.run(["bash", str(UP)], check=True, capture_output=True, timeout=120)
        self.ctld_stopped = False

    def restore(self) -> None:
        if self.ctld_stopped:
            self.start_slurmctld()
        for node in dict.fromkeys(self.downed):
            self.jobs.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        # every node idle or busy again and answering (a "*" suffix: slurmctld cannot reach it)
        end = time.monotonic() + 60
        while True:
            out = self.jobs.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split("\n")
            bad = [line for line in out if line and not re.fullmatch(r"\S+ (idle|mix|alloc|comp)", line)]
            if not bad:
                return
            assert time.monotonic() < end, f"nodes not back after a fault test: {bad}"
            time.sleep(0.5)


@pytest.fixture
def cluster_faults(slurm_jobs) -> Iterator[ClusterFaults]:
    """Requests slurm_jobs first, so nodes and slurmctld are back before its teardown cancels jobs."""
    f = ClusterFaults(slurm_jobs)
    try:
        yield f
    finally:
        f.restore()


def _attempts(slurm_jobs, job: str) -> dict[str, list[tuple[str, list[str]]]]:
    """Per record (array task, het component): every attempt's (state, nodes), oldest first."""
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for row in slurm_jobs.sacct([job], ("JobID", "State", "NodeList"), attempts=True):
        nodes = slurm_jobs.run(["scontrol", "show", "hostnames", row["NodeList"]]).stdout.split()
        out.setdefault(row["JobID"], []).append((row["State"].split()[0], nodes))
    return out


def _nodes_of(slurm_jobs, record: str) -> list[str]:
    """The nodes a running job record (``JOB``, ``JOB_1``, ``JOB+1``) runs on, from slurmctld."""
    out = slurm_jobs.run(["squeue", "-h", "-j", record.split("_")[0].split("+")[0], "-o", "%i %N"]).stdout
    nodelist = dict(line.split() for line in out.splitlines())[record]
    return slurm_jobs.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def _wait_n_held(slurm_jobs, job: str, holds: Path, point: str, n: int) -> list[int]:
    """The pids of ``n`` processes (array tasks, ranks) holding at ``point``."""
    _wait_held(slurm_jobs, job, holds, point)
    end = time.monotonic() + 120
    while len(pids := faults.held_pids(holds, point)) < n:
        assert time.monotonic() < end and slurm_jobs.active([job]), (pids, _log(slurm_jobs.workdir, job))
        time.sleep(0.1)
    return pids


@pytest.mark.slow
def test_teacher_task_on_a_node_set_down_is_requeued_elsewhere(tmp_path, slurm_jobs, cluster_faults,
                                                               recipe_all_local):
    """Slow: the requeued task starts again only after its begin time (cred_expire, ~11 s)."""
    local = recipe_all_local[0]
    run_dir = tmp_path / "run"
    shutil.copytree(local, run_dir, ignore=shutil.ignore_patterns("labels", "parent", "train", "calibrated", "eval"))
    profile = tmp_path / "one-task-a-node.yaml"
    profile.write_text("stages:\n  teacher: {mem_gb: 40}\n")  # 64 GB nodes: each task on its own node
    holds = tmp_path / "holds"
    meta = submit(run_dir, "teacher", env=_hold(holds, "stage-teacher"), args=["--cluster", str(profile)])
    job = job_ids(meta)["teacher"][0]
    _wait_n_held(slurm_jobs, job, holds, "stage-teacher", 2)
    logs = tmp_path / "logs" / "run"
    pid = {k: int(re.search(r"holding at stage-teacher \(pid (\d+)\)", (logs / f"teacher_{k}.log").read_text())[1])
           for k in (0, 1)}
    (node,) = _nodes_of(slurm_jobs, f"{job}_1")
    (other,) = _nodes_of(slurm_jobs, f"{job}_0")
    assert node != other
    cluster_faults.down(node, "teacher task 1 runs here")
    _wait_gone(pid[1])  # the task on the downed node is killed...
    os.kill(pid[0], 0)  # ...and the other task still holds
    faults.release(holds, "stage-teacher")
    states = wait_all(slurm_jobs, meta, deadline_s=REQUEUE_DEADLINE_S)
    assert set(states.values()) == {"COMPLETED"}, states

    tries = _attempts(slurm_jobs, job)
    assert tries[f"{job}_0"] == [("COMPLETED", [other])], tries
    (first, *_, last) = tries[f"{job}_1"]
    assert first == ("NODE_FAIL", [node]) and last[0] == "COMPLETED" and node not in last[1], tries
    for rel in ("labels/teacher.jsonl", "labels/teacher_train.jsonl"):
        assert sha256_file(run_dir / rel) == sha256_file(local / rel), rel


def test_slurmctld_stopped_and_restarted_mid_run(tmp_path, slurm_jobs, cluster_faults, recipe_all_local):
    """`fetch` then `build` (afterok): fetch finishes while slurmctld is stopped; `status` answers
    before, during (from sacct) and after; once slurmctld is back, build runs."""
    local = recipe_all_local[0]
    run_dir = tmp_path / "run"
    holds = tmp_path / "holds"
    meta = submit(run_dir, "fetch", "build", env=_hold(holds, "stage-fetch"))
    ids = {name: v[0] for name, v in job_ids(meta).items()}
    _wait_held(slurm_jobs, ids["fetch"], holds, "stage-fetch")
    assert re.search(rf"fetch\s+{ids['fetch']}\s+-\s+RUNNING", run_cli("status", str(run_dir)).stdout)

    cluster_faults.stop_slurmctld()
    faults.release(holds, "stage-fetch")  # fetch ends while only its slurmd knows
    stages = run_dir / "stages.jsonl"
    end = time.monotonic() + 60
    while '"stage": "fetch"' not in (stages.read_text() if stages.exists() else ""):
        assert time.monotonic() < end, "fetch did not finish while slurmctld was stopped"
        time.sleep(0.1)
    t0 = time.monotonic()
    out = run_cli("status", str(run_dir)).stdout
    assert time.monotonic() - t0 < 10, out  # `scontrol ping` says DOWN at once: squeue is not asked
    # accounting answers (its view lags: what slurmctld had not sent yet comes after its restart)
    assert out.splitlines()[0].endswith("state from sacct (slurmctld DOWN)"), out
    fetched = sha256_file(run_dir / "data/raw/MANIFEST.json")[:12]
    assert re.search(rf"^fetch\s+{ids['fetch']}\s.*{fetched}\s+data/raw/MANIFEST.json$", out, re.M), out
    assert re.search(rf"^build\s+{ids['build']}\s", out, re.M), out

    cluster_faults.start_slurmctld()
    states = wait_all(slurm_jobs, meta, deadline_s=120)
    assert states == {ids["fetch"]: "COMPLETED", ids["build"]: "COMPLETED"}, states
    out = run_cli("status", str(run_dir)).stdout
    assert "state from sacct+squeue" in out and "failed or cancelled" not in out, out
    for rel in ("data/raw/MANIFEST.json", "data/build/train.jsonl", "data/build/eval.jsonl"):
        assert sha256_file(run_dir / rel) == sha256_file(local / rel), rel


@pytest.mark.slow
def test_training_job_on_a_node_set_down_is_requeued_and_resumes(tmp_path, slurm_jobs, cluster_faults,
                                                                 tiny_training):
    """`train` on 2 nodes x 1 rank, held before step 3 (checkpoints of steps 1 and 2 written); its
    first node (the rendezvous host) set DOWN. Slow: the requeued job waits ~11 s to start again."""
    run_dir = tiny_training.copy_inputs(tmp_path / "run")
    profile = tmp_path / "two-nodes.yaml"
    profile.write_text("stages:\n  train: {nodes: 2}\n")
    holds = tmp_path / "holds"
    meta = submit(run_dir, "train", env=_hold(holds, "train-step-3"),
                  args=["--cluster", str(profile), "--train-config", str(tiny_training.configs["train"])])
    (job,) = job_ids(meta)["train"]
    pids = _wait_n_held(slurm_jobs, job, holds, "train-step-3", 2)
    nodes = _nodes_of(slurm_jobs, job)
    cluster_faults.down(nodes[0], "train's first node")
    for pid in pids:  # both ranks end: the job is killed on every node
        _wait_gone(pid)
    faults.release(holds, "train-step-3")
    states = wait_all(slurm_jobs, meta, deadline_s=REQUEUE_DEADLINE_S)
    assert states == {job: "COMPLETED"}, states

    (first, *_, last) = _attempts(slurm_jobs, job)[job]
    assert first == ("NODE_FAIL", nodes) and last[0] == "COMPLETED" and nodes[0] not in last[1], (first, last)
    again = (tmp_path / "logs" / "run" / "train.attempt1.log").read_text()
    resumed = [json.loads(line) for line in again.splitlines() if line.startswith('{"resumed_from"')]
    assert [(Path(r["resumed_from"]).name, r["step"]) for r in resumed] == [("step_00000002", 2)], again
    for name in ("adapter.safetensors", "head.safetensors"):
        assert sha256_file(run_dir / "train" / "final" / name) == sha256_file(tiny_training.two_ranks["train"] / name)


@pytest.mark.slow
def test_rl_rollout_node_set_down_requeues_the_job_which_resumes(slurm_jobs, cluster_faults,
                                                                   reference):  # noqa: F811
    """The trainer holds between checkpoint 1 and update 2; the rollout component's node is set
    DOWN. The het job (`--requeue`) is requeued whole and resumes from checkpoint 1.
    Slow: slurmctld starts a requeued het job from backfill, after its begin time (~11 s)."""
    run = slurm_jobs.workdir / "run"
    holds = slurm_jobs.workdir / "holds"
    job = _submit(slurm_jobs, "grpo.sh", _env(run, **_hold(holds, "update-2")))
    trainer = _wait_held(slurm_jobs, job, holds, "update-2")
    server = json.loads(next((run / "engine").glob("address-*.json")).read_text())["pid"]
    (serve_node,) = _nodes_of(slurm_jobs, f"{job}+1")
    cluster_faults.down(serve_node, "the rollout component runs here")
    _wait_gone(server)
    _wait_gone(trainer)
    faults.release(holds, "update-2")
    rows = slurm_jobs.wait(job, deadline_s=REQUEUE_DEADLINE_S)
    log = _log(slurm_jobs.workdir, job)
    assert {r["State"] for r in rows} == {"COMPLETED"}, log

    tries = _attempts(slurm_jobs, job)
    (first, *_, last) = tries[f"{job}+1"]
    assert first == ("NODE_FAIL", [serve_node]) and last[0] == "COMPLETED" and serve_node not in last[1], tries
    sessions = json.loads((run / "run.json").read_text())["rl"]["sessions"]
    assert [s["updates_run"] for s in sessions] == [[1], [2]]
    assert sessions[1]["resumed_from"] == "checkpoints/update-000001"
    _assert_same(reference, run)
