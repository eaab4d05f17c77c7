import json

from hobson.launch.backends.local import LocalBackend
from hobson.launch.dag import JobSpec, Resources
from hobson.records import RunPaths, new_run_json, read_stage_records, write_run_json

JOB = "tests.launch.sample_jobs"


def make_run(tmp_path):
    paths = RunPaths.create(tmp_path / "run", tmp_path / "logs")
    paths.run_dir.mkdir(parents=True)
    write_run_json(paths, new_run_json(paths, argv=["test"], backend="local", options={}, config_digests={}))
    return paths


def array_job(paths, n=4, fail=None, cpus=1, throttle=2):
    out = f"{paths.run_dir}/out.{{shard}}.json"
    args = ["--out", out, "--shard", "{shard}", "--sleep", "0.3"] + (["--fail-shard", str(fail)] if fail is not None
                                                                     else [])
    return JobSpec(name="arr", stage="arr", job=JOB, job_args=args, inputs=[], outputs=["out.{shard}.json"],
                   resources=Resources(gpus=1, cpus=cpus), shards=list(range(n)), num_shards=n, throttle=throttle)


def single_job(paths, name="after"):
    return JobSpec(name=name, stage=name, job=JOB, job_args=["--out", f"{paths.run_dir}/{name}.json"], inputs=[],
                   outputs=[f"{name}.json"], resources=Resources(cpus=2), after=["arr"])


def test_array_runs_every_shard_on_gpu_slots_with_fixed_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "999")  # must not leak into jobs
    paths = make_run(tmp_path)
    assert LocalBackend(ngpu=2).run([array_job(paths), single_job(paths)], paths, echo=lambda s: None) == 0
    seen = [json.loads((paths.run_dir / f"out.{s}.json").read_text()) for s in range(4)]
    assert [s["shard"] for s in seen] == [0, 1, 2, 3]
    assert [s["task"] for s in seen] == ["0", "1", "2", "3"]
    assert {s["cuda_visible_devices"] for s in seen} <= {"0", "1"}
    assert all(s["omp"] == "1" and s["torch_threads"] == 1 and s["slurm_leak"] == [] for s in seen)
    after = json.loads((paths.run_dir / "after.json").read_text())
    assert after["torch_threads"] == 2 and after["cuda_visible_devices"] == ""
    recs = [r for r in read_stage_records(paths) if r["stage"] == "arr"]
    assert len(recs) == 4 and all(r["status"] == "ok" and r["outputs"][0]["sha256"] for r in recs)
    # throttle 2: at no instant were more than two tasks running
    events = sorted([(r["start_utc"], 1) for r in recs] + [(r["end_utc"], -1) for r in recs], key=lambda e: e)
    running = peak = 0
    for _, d in events:
        running += d
        peak = max(peak, running)
    assert peak <= 2
    assert (paths.logs_dir / "arr_3.log").exists() and (paths.logs_dir / "after.log").exists()


def test_failed_shard_stops_dependents_and_retry_runs_only_it(tmp_path):
    paths = make_run(tmp_path)
    lines = []
    code = LocalBackend(ngpu=4).run([array_job(paths, fail=2, throttle=4), single_job(paths)], paths,
                                    echo=lines.append)
    assert code == 7
    assert not (paths.run_dir / "after.json").exists()
    report = "\n".join(lines)
    assert "arr shard 2] FAILED (exit 7)" in report and "injected failure in shard 2" in report
    mtimes = {s: (paths.run_dir / f"out.{s}.json").stat().st_mtime_ns for s in (0, 1, 3)}
    (paths.run_dir / "out.2.json.allow").write_text("")
    lines.clear()
    assert LocalBackend(ngpu=4).run([array_job(paths, fail=2, throttle=4), single_job(paths)], paths,
                                    echo=lines.append) == 0
    assert "running shards 2" in "\n".join(lines)
    assert {s: (paths.run_dir / f"out.{s}.json").stat().st_mtime_ns for s in (0, 1, 3)} == mtimes
    assert (paths.run_dir / "after.json").exists()
    # a third run has nothing left to do
    lines.clear()
    assert LocalBackend(ngpu=4).run([array_job(paths), single_job(paths)], paths, echo=lines.append) == 0
    assert all("skipped" in line for line in lines)


def test_job_threads_sleep_while_they_wait_unless_the_user_says(tmp_path, monkeypatch):
    # an array's tasks share the host's cores: spinning OpenMP threads would take them from each other
    from hobson.launch.backends.base import job_environ

    job = single_job(make_run(tmp_path))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = job_environ(job)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert job_environ(job)["OMP_WAIT_POLICY"] == "ACTIVE"
