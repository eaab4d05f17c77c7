"""`submit.py serve --backend slurm`: the decider server as a job on the local cluster.

The job listens on its node's address on a free port, guarded by the token the launcher wrote;
`status` finds its address in the run directory and says it is ready, `ask --server RUN` gets
what `ask CKPT` prints, and `cancel` stops it (the server answers what it holds, then leaves).
"""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import httpx

ASK = ["--state", "the red box", "--choice", "Which one?=apple,river,stone", "--kind", "noul"]


def test_serve_job_status_ask_server_and_cancel(slurm_jobs, calibrated: Path, tmp_path: Path, capsys) -> None:
    from hobson.jobs import ask as ask_job
    from tests.conftest import run_cli

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("stages: {serve: {cpus: 1, mem_gb: 2, time: '00:10:00'}}\n")
    run_dir = slurm_jobs.workdir / "served"
    run_cli("serve", str(calibrated), "--backend", "slurm", "--cluster", str(cluster), "--run-dir", str(run_dir),
            "--logs-dir", str(slurm_jobs.workdir / "logs"), "--threads", "1")
    meta = json.loads((run_dir / "run.json").read_text())
    (sub,) = meta["submissions"]
    job = sub["job_id"]
    slurm_jobs.submitted.append(job)
    token = run_dir / "serve" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    address = run_dir / "serve" / "address.json"
    end = time.monotonic() + 120
    while not address.exists():  # the job started its server
        assert slurm_jobs.active([job]), slurm_jobs.sacct([job])
        assert time.monotonic() < end
        time.sleep(0.2)
    a = json.loads(address.read_text())
    with httpx.Client(base_url=a["url"], timeout=60) as c:
        while c.get("/healthz").status_code != 200:  # loaded
            assert slurm_jobs.active([job]) and time.monotonic() < end, slurm_jobs.sacct([job])
            time.sleep(0.2)
    status = run_cli("status", str(run_dir)).stdout
    assert f"serve: {a['url']} on node" in status and "): ready" in status, status
    assert a["job_id"] == job and a["token_file"] == str(token.resolve())
    assert ask_job.main([str(calibrated), *ASK]) == 0
    local = capsys.readouterr().out
    assert ask_job.main(["--server", str(run_dir), *ASK]) == 0
    assert capsys.readouterr().out == local
    assert ask_job.main(["--server", a["url"], *ASK]) == 1  # without the token the server refuses
    assert "HTTP 401" in capsys.readouterr().err
    assert f"cancelled jobs {job}" in run_cli("cancel", str(run_dir)).stdout
    slurm_jobs.wait(job, deadline_s=60)
    assert not address.exists()  # the server left cleanly and took its address with it
    log = (slurm_jobs.workdir / "logs" / "served" / "serve.log").read_text()
    assert "serve: listening on" in log and "serve: stopped" in log, log
