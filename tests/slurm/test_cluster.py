"""The local dev cluster itself does what the Slurm backend relies on (each test < 20 s).

These pin the cluster behaviours the launcher is built on: throttled arrays, a dependency on a
failed job being cancelled rather than pending forever, het-job components on different nodes,
fake GPUs showing up as CUDA_VISIBLE_DEVICES, and sacct reporting states and exit codes.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # conftest is not importable as a module at run time; fixtures hand these over
    from conftest import SlurmCluster, SlurmJobs


def test_cluster_has_four_nodes_with_eight_fake_gpus(slurm_cluster: SlurmCluster,
                                                    slurm_jobs: SlurmJobs) -> None:
    assert sorted(slurm_cluster.nodes) == ["n1", "n2", "n3", "n4"]
    assert slurm_cluster.accounting, "sacct fails: is slurmdbd up? (tests/cluster/dbd.sh start)"
    gres = slurm_jobs.run(["sinfo", "-h", "-N", "-o", "%N %G"]).stdout.split()
    assert sorted(set(gres[1::2])) == ["gpu:8"]


def test_array_throttle_runs_every_task_at_most_two_at_once(slurm_jobs: SlurmJobs) -> None:
    # each task logs its own start and end time; %2 must keep at most two intervals overlapping
    job = slurm_jobs.sbatch("--array=0-5%2", "-o", "arr_%a.out",
                            "--wrap", "date +%s.%N; sleep 1; date +%s.%N")
    assert "ArrayTaskThrottle=2" in slurm_jobs.run(["scontrol", "show", "job", job]).stdout
    rows = slurm_jobs.wait(job)
    assert sorted(r["JobID"] for r in rows) == [f"{job}_{k}" for k in range(6)]
    assert {r["State"] for r in rows} == {"COMPLETED"}
    events = []
    for k in range(6):
        start, end = (float(t) for t in (slurm_jobs.workdir / f"arr_{k}.out").read_text().split())
        events += [(start, 1), (end, -1)]
    running = peak = 0
    for _, step in sorted(events):
        running += step
        peak = max(peak, running)
    assert 1 <= peak <= 2


def test_afterok_on_failed_job_is_cancelled_with_kill_on_invalid_dep(slurm_jobs: SlurmJobs) -> None:
    failed = slurm_jobs.sbatch("-o", "failed.out", "--wrap", "exit 3")
    killed = slurm_jobs.sbatch(f"--dependency=afterok:{failed}", "--kill-on-invalid-dep=yes",
                               "-o", "killed.out", "--wrap", "echo must-not-run")
    # the same dependency without the flag is what the launcher must never submit: it pends forever
    stuck = slurm_jobs.sbatch(f"--dependency=afterok:{failed}", "--kill-on-invalid-dep=no",
                              "-o", "stuck.out", "--wrap", "echo must-not-run")
    rows = {r["JobID"]: r for r in slurm_jobs.wait(failed, killed)}
    assert (rows[failed]["State"], rows[failed]["ExitCode"]) == ("FAILED", "3:0")
    assert rows[killed]["State"] == "CANCELLED"
    shown = slurm_jobs.run(["scontrol", "show", "job", killed]).stdout
    assert "JobState=CANCELLED Reason=DependencyNeverSatisfied" in shown
    assert not (slurm_jobs.workdir / "killed.out").exists()
    assert slurm_jobs.active([stuck]) == [f"{stuck} PENDING DependencyNeverSatisfied"]


HET_SCRIPT = """#!/bin/bash
#SBATCH -o het.out
#SBATCH -N1 -n1 --gpus-per-node=1
#SBATCH hetjob
#SBATCH -N1 -n1
echo "group0 $SLURMD_NODENAME"
srun --het-group=1 bash -c 'echo "group1 $SLURMD_NODENAME"'
"""


def test_het_job_components_run_on_different_nodes(slurm_jobs: SlurmJobs) -> None:
    job = slurm_jobs.sbatch(script=HET_SCRIPT)
    rows = slurm_jobs.wait(job, fields=("NodeList",))
    assert [(r["JobID"], r["State"]) for r in rows] == [(f"{job}+0", "COMPLETED"), (f"{job}+1", "COMPLETED")]
    seen = dict(line.split() for line in (slurm_jobs.workdir / "het.out").read_text().splitlines())
    assert set(seen) == {"group0", "group1"}
    assert seen["group0"] != seen["group1"]   # hostname is the same on every node: trust SLURMD_NODENAME
    assert [r["NodeList"] for r in rows] == [seen["group0"], seen["group1"]]


def test_fake_gpu_gres_sets_cuda_visible_devices(slurm_jobs: SlurmJobs) -> None:
    rows = slurm_jobs.submit_and_wait("--gres=gpu:2", "-o", "gpu.out",
                                      "--wrap", 'echo "$CUDA_VISIBLE_DEVICES"', fields=("AllocTRES",))
    assert rows[0]["State"] == "COMPLETED"
    assert "gres/gpu=2" in rows[0]["AllocTRES"].split(",")
    ids = (slurm_jobs.workdir / "gpu.out").read_text().strip().split(",")
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.isdigit() for i in ids), ids


def test_sacct_reports_completed_failed_and_cancelled(slurm_jobs: SlurmJobs) -> None:
    ok = slurm_jobs.sbatch("-o", "ok.out", "--wrap", "echo fine")
    bad = slurm_jobs.sbatch("-o", "bad.out", "--wrap", "exit 7")
    slow = slurm_jobs.sbatch("-o", "slow.out", "--wrap", "echo started; sleep 300")
    end = time.monotonic() + 15
    while "started" not in _read(slurm_jobs, "slow.out"):
        assert time.monotonic() < end, f"job {slow} never started: {slurm_jobs.active([slow])}"
        time.sleep(0.2)
    slurm_jobs.run(["scancel", slow])
    rows = {r["JobID"]: r for r in slurm_jobs.wait(ok, bad, slow)}
    assert (rows[ok]["State"], rows[ok]["ExitCode"]) == ("COMPLETED", "0:0")
    assert (rows[bad]["State"], rows[bad]["ExitCode"]) == ("FAILED", "7:0")
    assert re.fullmatch(r"CANCELLED by \d+", rows[slow]["State"]), rows[slow]
    assert _read(slurm_jobs, "ok.out") == "fine\n"


def _read(jobs: SlurmJobs, name: str) -> str:
    path = jobs.workdir / name
    return path.read_text() if path.exists() else ""
