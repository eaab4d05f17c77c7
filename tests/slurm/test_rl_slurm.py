"""RL as a heterogeneous Slurm job on the local cluster: sbatch/grpo.sh (and ppo, dppo,
flow_dppo) with the tiny Huginn on CPU.

One in-process run on this machine (``python -m jobs.rl``'s main, the engine in-process, one
torch thread) is the reference: the het job, the colocated job, the job killed mid-run and then
resumed, and the stop-after-1-then-resume pair of jobs must all end with the same bits
(``compare_runs``: weights, optimizer, RNG, rollouts, publication digests). The components'
nodes come from sacct (``JOBID+0``/``JOBID+1``), the rollouts' nodes from each sample's
``engine_node`` ($SLURMD_NODENAME of the server).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from hobson import faults
from hobson.io import read_jsonl
from hobson.rl.verify_resume import compare_runs

REPO = Path(__file__).resolve().parents[2]
RL_ARGS = "--reward test-token-value --max-new-tokens 6 --prompts-per-update 2 --completions-per-prompt 2 --lr 0.1"
UPDATES = 2
DEADLINE_S = 240.0
# how long a requeued job waits before slurmctld starts it again varies: the whole requeue test
# took 40 s on one CI run and 198 s on the next
REQUEUE_DEADLINE_S = 480.0
REQUEST_TIMEOUT = 60


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same GRPO run on the local backend: in-process engine, one thread."""
    from hobson.jobs.rl import main

    out = tmp_path_factory.mktemp("rl-local") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["--algorithm", "grpo", "--output", str(out), "--updates", str(UPDATES), "--device", "cpu",
                     *RL_ARGS.split()]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def _env(output: Path, **more: str) -> dict[str, str]:
    env = {
        "HOBSON_REPO": str(REPO),
        "DEVICE": "cpu",
        "THREADS": "1",
        "OUTPUT": str(output),
        "UPDATES": str(UPDATES),
        "RL_ARGS": RL_ARGS,
        "READY_TIMEOUT": "120",
        "REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
        "PUBLISH_TIMEOUT": str(REQUEST_TIMEOUT),
    }
    env.update(more)
    return env


def _log(workdir: Path, job_id: str) -> str:
    return "\n".join(p.read_text() for p in sorted((workdir / "logs").glob(f"*-{job_id}.log")))


def _assert_same(reference: Path, run: Path) -> None:
    diffs = [i.line() for i in compare_runs(reference, run) if i.difference]
    assert diffs == [], diffs


def _assert_whole(run: Path) -> None:
    """Nothing half-written: no temporary entries, every publication and checkpoint complete."""
    leftovers = [str(p.relative_to(run)) for p in run.rglob(".*")]
    assert leftovers == []
    for pub in (run / "publications").glob("*"):
        assert (pub / "manifest.json").is_file(), pub
    for ck in (run / "checkpoints").glob("*"):
        assert (ck / "state.pt").is_file(), ck
    for f in (run / "rollouts").glob("*"):
        read_jsonl(f)


def _hold(root: Path, point: str) -> dict[str, str]:
    """The environment that makes the run hold at ``point`` (hobson.faults) until released."""
    return {faults.ENV_POINTS: point, faults.ENV_DIR: str(root)}


def _wait_held(slurm_jobs, job: str, root: Path, point: str) -> int:
    """The pid of the trainer holding at ``point``; fails at once (with the logs) if the job ended first."""
    try:
        return faults.wait_held(root, point, DEADLINE_S, alive=lambda: bool(slurm_jobs.active([job])))
    except (TimeoutError, RuntimeError) as e:
        pytest.fail(f"{e}\n{_log(slurm_jobs.workdir, job)}")


def _wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < end, f"pid {pid} still alive after {timeout_s:.0f} s"
        time.sleep(0.05)


def _submit(slurm_jobs, script: str, env: dict[str, str], *options: str) -> str:
    (slurm_jobs.workdir / "logs").mkdir(exist_ok=True)
    return slurm_jobs.sbatch(*options, str(REPO / "sbatch" / script), env=env)


def test_grpo_het_job_components_on_two_nodes_same_bits(slurm_jobs, reference: Path) -> None:
    run = slurm_jobs.workdir / "run"
    job = _submit(slurm_jobs, "grpo.sh", _env(run))
    slurm_jobs.wait(job, deadline_s=DEADLINE_S)
    rows = {r["JobID"]: r for r in slurm_jobs.sacct([job], ("JobID", "State", "ExitCode", "NodeList"))}
    assert {rows[f"{job}+{k}"]["State"] for k in (0, 1)} == {"COMPLETED"}, (rows, _log(slurm_jobs.workdir, job))
    train_node, serve_node = rows[f"{job}+0"]["NodeList"], rows[f"{job}+1"]["NodeList"]
    assert train_node != serve_node
    for k in range(1, UPDATES + 1):
        samples = read_jsonl(run / "rollouts" / f"update-{k:06d}.jsonl")
        assert samples and {s["engine_node"] for s in samples} == {serve_node}
    _assert_same(reference, run)
    assert "hobson-rl: done" in _log(slurm_jobs.workdir, job)


def test_colocated_single_component_same_bits(slurm_jobs, reference: Path) -> None:
    """The colocated script, submitted the way `submit.py rl --backend slurm --colocated` does
    (rendered from flags, through submitit's executor)."""
    from hobson.launch.backends.slurm import submit_script
    from hobson.launch.backends.slurm_scripts import script_for_profile
    from hobson.launch.options import ClusterProfile
    from hobson.records import RunPaths, new_run_json, write_run_json

    paths = RunPaths.create(slurm_jobs.workdir / "launch-run", slurm_jobs.workdir / "logs")
    paths.run_dir.mkdir(parents=True)
    write_run_json(paths, new_run_json(paths, argv=["test"], backend="slurm", options={}, config_digests={}))
    run = paths.run_dir / "rl"
    script = script_for_profile(
        ["--algorithm", "grpo", "--output", str(run), "--updates", str(UPDATES), "--device", "cpu",
         *RL_ARGS.split()],
        ClusterProfile(), str(paths.log("rl")), colocated=True, train_mem="4G", train_cpus=2, rollout_cpus=2,
        env={"THREADS": "1"},
    )
    assert "hetjob" not in script and "export COLOCATED=1" in script
    job = submit_script(script, paths, "rl")
    slurm_jobs.submitted.append(job)
    rows = slurm_jobs.wait(job, deadline_s=DEADLINE_S, fields=("JobID", "State", "NodeList"))
    log = paths.log("rl").read_text() if paths.log("rl").exists() else "(no log)"
    assert [r["JobID"] for r in rows] == [job]  # one component
    assert rows[0]["State"] == "COMPLETED", log
    node = rows[0]["NodeList"]
    samples = read_jsonl(run / "rollouts" / "update-000001.jsonl")
    assert {s["engine_node"] for s in samples} == {node}
    assert json.loads(paths.run_json.read_text())["submissions"][0]["job_id"] == job
    _assert_same(reference, run)


def test_stop_after_then_resume_as_two_jobs(slurm_jobs, reference: Path) -> None:
    run = slurm_jobs.workdir / "run"
    first = _submit(slurm_jobs, "grpo.sh", _env(run, STOP_AFTER="1"))
    slurm_jobs.wait(first, deadline_s=DEADLINE_S)
    assert not (run / "checkpoints" / "update-000002").exists()
    second = _submit(slurm_jobs, "grpo.sh", _env(run))  # RESUME=auto: the run.json is there
    rows = slurm_jobs.wait(second, deadline_s=DEADLINE_S)
    assert {r["State"] for r in rows} == {"COMPLETED"}, _log(slurm_jobs.workdir, second)
    sessions = json.loads((run / "run.json").read_text())["rl"]["sessions"]
    assert [s["updates_run"] for s in sessions] == [[1], [2]]
    assert sessions[1]["resumed_from"] == "checkpoints/update-000001"
    _assert_same(reference, run)


@pytest.mark.slow
def test_usr2_requeues_and_the_job_resumes(slurm_jobs, reference: Path) -> None:
    """USR2 to the batch shell (what --signal=B:USR2@120 sends before the time limit): the job
    requeues itself, runs again under the same id and OUTPUT, and resumes from checkpoint 1,
    republishing version 1 before its first rollout.
    Slow: slurmctld takes its time to start a requeued job again."""
    run = slurm_jobs.workdir / "run"
    holds = slurm_jobs.workdir / "holds"
    job = _submit(slurm_jobs, "grpo.sh", _env(run, **_hold(holds, "update-2")))
    pid = _wait_held(slurm_jobs, job, holds, "update-2")  # checkpoint 1 whole, update 2 not begun
    slurm_jobs.run(["scancel", "--batch", "--signal=USR2", job])
    _wait_gone(pid)  # the requeue ended the held trainer; the requeued run passes the point
    faults.release(holds, "update-2")
    rows = slurm_jobs.wait(job, deadline_s=REQUEUE_DEADLINE_S)
    log = _log(slurm_jobs.workdir, job)
    assert {r["State"] for r in rows} == {"COMPLETED"}, log
    assert f"USR2: requeueing job {job}" in log
    sessions = json.loads((run / "run.json").read_text())["rl"]["sessions"]
    assert [s["updates_run"] for s in sessions] == [[1], [2]]
    assert sessions[1]["resumed_from"] == "checkpoints/update-000001"
    events = [(e["event"], e.get("version")) for e in sessions[1]["events"]]
    assert events[:3] == [("load_checkpoint", 1), ("publish", 1), ("rollout", 1)]
    _assert_same(reference, run)


def test_killed_rollout_component_fails_job_then_resume(slurm_jobs, reference: Path) -> None:
    """The rollout server killed while the trainer holds between checkpoint 1 and update 2: the
    job fails naming the rollout component, and the same script resumes it from checkpoint 1."""
    run = slurm_jobs.workdir / "run"
    holds = slurm_jobs.workdir / "holds"
    job = _submit(slurm_jobs, "grpo.sh", _env(run, **_hold(holds, "update-2")))
    _wait_held(slurm_jobs, job, holds, "update-2")
    address = json.loads(next((run / "engine").glob("address-*.json")).read_text())
    os.kill(address["pid"], signal.SIGKILL)  # the cluster's nodes are processes on this host
    _wait_gone(address["pid"])
    killed = time.monotonic()
    faults.release(holds, "update-2")  # update 2's rollout now meets a dead server
    rows = slurm_jobs.wait(job, deadline_s=DEADLINE_S)
    states = {r["JobID"]: r["State"] for r in rows}
    assert states[f"{job}+0"] == "FAILED", states
    log = _log(slurm_jobs.workdir, job)
    assert "FAILED: the rollout component (het group 1)" in log, log
    assert time.monotonic() - killed < REQUEST_TIMEOUT
    assert not (run / "checkpoints" / "update-000002").exists()
    _assert_whole(run)
    again = _submit(slurm_jobs, "grpo.sh", _env(run))  # the same script resumes the run
    rows = slurm_jobs.wait(again, deadline_s=DEADLINE_S)
    assert {r["State"] for r in rows} == {"COMPLETED"}, _log(slurm_jobs.workdir, again)
    _assert_same(reference, run)
    _assert_whole(run)


@pytest.mark.slow
def test_hung_rollout_component_detected_by_timeouts(slurm_jobs) -> None:
    """A server that stops answering (SIGSTOP: its port still accepts) once it serves version 0:
    update 1's generate gets no answer within its timeout.
    Slow: it waits out the request timeout it tests."""
    from hobson.rollout.transport import read_address, request

    run = slurm_jobs.workdir / "run"
    holds = slurm_jobs.workdir / "holds"
    job = _submit(slurm_jobs, "grpo.sh", _env(run, UPDATES="1", REQUEST_TIMEOUT="10", PUBLISH_TIMEOUT="10",
                                              **_hold(holds, "update-1")))
    _wait_held(slurm_jobs, job, holds, "update-1")  # version 0 published: the server is configured
    address = read_address(next((run / "engine").glob("address-*.json")))  # with the job's secret
    assert address is not None and request(address, {"op": "ping"}, 10)["configured"]
    os.kill(address["pid"], signal.SIGSTOP)
    hung = time.monotonic()
    faults.release(holds, "update-1")  # update 1's rollout asks a server that never answers
    try:
        rows = slurm_jobs.wait(job, deadline_s=DEADLINE_S)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(address["pid"], sig)
            except ProcessLookupError:
                pass
    assert {r["JobID"]: r["State"] for r in rows}[f"{job}+0"] == "FAILED"
    log = _log(slurm_jobs.workdir, job)
    assert "within 10 s (engine hung?)" in log, log
    assert "FAILED: the rollout component (het group 1) is gone or not answering" in log, log
    assert time.monotonic() - hung < 60  # 10 s request timeout + the script's 10 s ping + stopping
    _assert_whole(run)


def test_each_algorithm_script_runs_one_update(slurm_jobs) -> None:
    scripts = ["ppo.sh", "dppo.sh", "flow_dppo.sh"]
    # command-line options apply to every component: small ones, so the three jobs run at once
    jobs = {s: _submit(slurm_jobs, s, _env(slurm_jobs.workdir / s[:-3], UPDATES="1"), "--mem=4G",
                       "--cpus-per-task=2") for s in scripts}
    rows = slurm_jobs.wait(*jobs.values(), deadline_s=2 * DEADLINE_S)
    failed = sorted({r["JobID"].split("+")[0].split(".")[0] for r in rows if r["State"] != "COMPLETED"})
    if failed:  # pytest.fail, unlike an assert message, shows the whole logs
        pytest.fail("\n\n".join(f"job {j} {rows}:\n{_log(slurm_jobs.workdir, j)}" for j in failed))
    for script in scripts:
        run = slurm_jobs.workdir / script[:-3]
        settings = json.loads((run / "run.json").read_text())["rl"]["settings"]
        assert settings["algorithm"] == script[:-3].replace("_", "-")
        assert (run / "checkpoints" / "update-000001" / "state.pt").is_file()


def test_rl_through_the_launcher_status_cancel_retry(slurm_jobs, reference: Path, tmp_path: Path) -> None:
    """`submit.py rl --backend slurm` goes through the Slurm backend like a recipe run: one
    heterogeneous job whose components status shows as "training" (+0) and "rollout" (+1);
    `cancel` stops both while the trainer holds after checkpoint 1; `retry` resubmits it with
    --resume and the result equals the uninterrupted run bit for bit."""
    from tests.conftest import run_cli

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("stages: {rl: {cpus: 1, mem_gb: 2, time: '00:20:00'}}\n")
    run_dir = slurm_jobs.workdir / "launched"
    holds = slurm_jobs.workdir / "holds"
    argv = ["rl", "--backend", "slurm", "--cluster", str(cluster), "--run-dir", str(run_dir), "--logs-dir",
            str(slurm_jobs.workdir / "logs"), "--algorithm", "grpo", "--updates", str(UPDATES), "--device", "cpu",
            "--engine-timeout", str(REQUEST_TIMEOUT), "--publish-timeout", str(REQUEST_TIMEOUT),
            "--engine-ready-timeout", "120", *RL_ARGS.split()]
    dry = run_cli(*argv, "--dry-run").stdout
    assert "#SBATCH hetjob" in dry and "#SBATCH --cpus-per-task=1" in dry and "#SBATCH --mem=2G" in dry
    env = {"THREADS": "1", **_hold(holds, "update-2")}
    run_cli(*argv, env=env)
    meta = json.loads((run_dir / "run.json").read_text())
    (sub,) = meta["submissions"]
    job = sub["job_id"]
    slurm_jobs.submitted.append(job)
    assert sub["components"] == ["training", "rollout"] and meta["backend"] == "slurm"
    _wait_held(slurm_jobs, job, holds, "update-2")
    status = run_cli("status", str(run_dir)).stdout
    rows = {line.split()[1]: line for line in status.splitlines()[2:] if line.startswith("rl ")}
    assert set(rows) == {"training", "rollout"}, status
    assert f"{job}+0" in rows["training"] and f"{job}+1" in rows["rollout"], status
    assert "RUNNING" in rows["training"] and "RUNNING" in rows["rollout"], status
    assert "rl.log" in run_cli("logs", str(run_dir)).stdout
    assert f"cancelled jobs {job}" in run_cli("cancel", str(run_dir)).stdout
    faults.release(holds, "update-2")
    slurm_jobs.wait(job, deadline_s=DEADLINE_S)
    status = run_cli("status", str(run_dir)).stdout
    assert "failed or cancelled: rl training, rl rollout" in status, status
    assert not (run_dir / "rl" / "checkpoints" / "update-000002").exists()
    run_cli("retry", str(run_dir), env={"THREADS": "1"})
    last = json.loads((run_dir / "run.json").read_text())["submissions"][-1]
    again = last["job_id"]
    slurm_jobs.submitted.append(again)
    assert again != job and "export RESUME=1" in Path(last["script"]).read_text()
    rows = slurm_jobs.wait(again, deadline_s=DEADLINE_S)
    log = slurm_jobs.workdir / "logs" / "launched" / "rl.log"
    assert {r["State"] for r in rows} == {"COMPLETED"}, log.read_text() if log.exists() else "(no log)"
    sessions = json.loads((run_dir / "rl" / "run.json").read_text())["rl"]["sessions"]
    assert sessions[-1]["resumed_from"] == "checkpoints/update-000001"
    _assert_same(reference, run_dir / "rl")
    status = run_cli("status", str(run_dir)).stdout
    assert "failed or cancelled" not in status, status


def test_plain_sbatch_job_records_itself_for_status_logs_cancel_retry(slurm_jobs, reference: Path) -> None:
    """`sbatch sbatch/grpo.sh` (no launcher) writes the launcher's run record from inside the job:
    `status` shows both components while the trainer holds after checkpoint 1, `logs` prints the
    job's own log, `cancel` stops it, and `retry` resubmits it (same resources, --resume) to the
    uninterrupted run's bits."""
    from tests.conftest import run_cli

    run = slurm_jobs.workdir / "plain-out"
    run_dir = slurm_jobs.workdir / "plain-record"
    holds = slurm_jobs.workdir / "holds"
    job = _submit(slurm_jobs, "grpo.sh", _env(run, RUN_DIR=str(run_dir), **_hold(holds, "update-2")),
                  "--cpus-per-task=1", "--mem=2G")
    _wait_held(slurm_jobs, job, holds, "update-2")
    meta = json.loads((run_dir / "run.json").read_text())
    (sub,) = meta["submissions"]
    assert meta["backend"] == "slurm" and meta["options"]["started_by"] == "sbatch"
    assert sub["job_id"] == job and sub["components"] == ["training", "rollout"]
    assert meta["options"]["resources"]["training"]["cpus"] == 1, meta["options"]
    status = run_cli("status", str(run_dir)).stdout
    rows = {line.split()[1]: line for line in status.splitlines()[2:] if line.startswith("rl ")}
    assert set(rows) == {"training", "rollout"}, status
    assert f"{job}+0" in rows["training"] and "RUNNING" in rows["training"], status
    assert f"{job}+1" in rows["rollout"] and "RUNNING" in rows["rollout"], status
    assert "rollout component (het group 1) ready" in run_cli("logs", str(run_dir), "rl").stdout
    assert f"cancelled jobs {job}" in run_cli("cancel", str(run_dir)).stdout
    faults.release(holds, "update-2")
    slurm_jobs.wait(job, deadline_s=DEADLINE_S)
    assert "failed or cancelled: rl training, rl rollout" in run_cli("status", str(run_dir)).stdout
    run_cli("retry", str(run_dir), env={"THREADS": "1"})
    last = json.loads((run_dir / "run.json").read_text())["submissions"][-1]
    again = last["job_id"]
    slurm_jobs.submitted.append(again)
    script = Path(last["script"]).read_text()
    assert again != job and "export RESUME=1" in script and "#SBATCH --cpus-per-task=1" in script, script
    rows = slurm_jobs.wait(again, deadline_s=DEADLINE_S)
    assert {r["State"] for r in rows} == {"COMPLETED"}, run_cli("logs", str(run_dir), "rl").stdout
    _assert_same(reference, run)


@pytest.mark.slow
def test_three_rollout_servers_over_nodes_give_the_one_engine_run(slurm_jobs, tmp_path: Path) -> None:
    """`submit.py rl --backend slurm --rollout-servers 3 --transport dist`: the rollout component
    is 3 tasks (one server each, 6 CPUs each, so they need two nodes of 16); unit k of each update
    runs on server k mod 3; the run equals an in-process engine's bit for bit.
    Slow (~40 s): the in-process reference run, then a het job whose 4 processes each import torch."""
    from hobson.jobs.rl import main
    from tests.conftest import run_cli

    # 3 prompts x 2 completions, one request per unit: each update holds 6 = 2 x 3 units
    args = [*RL_ARGS.replace("--prompts-per-update 2", "--prompts-per-update 3").split(), "--rollout-unit", "1",
            "--algorithm", "grpo", "--updates", str(UPDATES), "--device", "cpu"]
    ref = tmp_path / "in-process"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*args, "--output", str(ref)]) == 0
    finally:
        torch.set_num_threads(threads)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("stages: {rl: {cpus: 6, mem_gb: 2, time: '00:20:00'}}\n")
    run_dir = slurm_jobs.workdir / "servers"
    argv = ["rl", "--backend", "slurm", "--cluster", str(cluster), "--run-dir", str(run_dir), "--logs-dir",
            str(slurm_jobs.workdir / "logs"), *args, "--rollout-servers", "3", "--transport", "dist",
            "--engine-timeout", str(REQUEST_TIMEOUT), "--publish-timeout", str(REQUEST_TIMEOUT),
            "--engine-ready-timeout", "120"]
    dry = run_cli(*argv, "--dry-run").stdout
    rollout_block = dry.split("#SBATCH hetjob", 1)[1]
    assert "#SBATCH --ntasks=3" in rollout_block and "#SBATCH --gpus-per-task=1" in rollout_block
    assert "#SBATCH --nodes" not in rollout_block and "export ROLLOUT_SERVERS=3" in dry
    run_cli(*argv, env={"THREADS": "1"})
    (sub,) = json.loads((run_dir / "run.json").read_text())["submissions"]
    job = sub["job_id"]
    slurm_jobs.submitted.append(job)
    rows = {r["JobID"]: r for r in slurm_jobs.wait(job, deadline_s=DEADLINE_S, fields=("JobID", "State", "NodeList"))}
    log = slurm_jobs.workdir / "logs" / "servers" / "rl.log"
    assert {r["State"] for r in rows.values()} == {"COMPLETED"}, log.read_text() if log.exists() else "(no log)"
    run = run_dir / "rl"
    for update in range(1, UPDATES + 1):
        served = read_jsonl(run / "rollouts" / f"update-{update:06d}.jsonl")
        assert [r["engine_server"] for r in served] == [k % 3 for k in range(6)]
        assert len({r["engine_pid"] for r in served}) == 3
        assert len({r["engine_node"] for r in served}) >= 2, served  # the tasks spread over nodes
    publishes = [e for s in json.loads((run / "run.json").read_text())["rl"]["sessions"] for e in s["events"]
                 if e["event"] == "publish"]
    assert publishes and {e["transport"] for e in publishes} == {"dist"}
    assert not (run / "publications").exists() or not any((run / "publications").iterdir())
    _assert_same(ref, run)
