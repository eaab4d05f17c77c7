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

from tests.serve.conftest import calibrated, config_factory, decider_data  # noqa: F401 - fixtures

ASK = ["--state", "the red box", "--choice", "Which one?=apple,river,stone", "--kind", "noul"]


def test_serve_job_status_ask_server_and_cancel(slurm_jobs, calibrated: Path, tmp_path: Path) -> None:  # noqa: F811
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
    while True:  # the job's server: started, loaded, answering
        status = run_cli("status", str(run_dir)).stdout
        if address.exists() and status.rstrip().endswith("--choice 'Q=a,b'") and "): ready" in status:
            break
        assert slurm_jobs.active([job]), (status, slurm_jobs.sacct([job]))
        assert time.monotonic() < end, status
        time.sleep(0.5)
    a = json.loads(address.read_text())
    assert a["job_id"] == job and a["token_file"] == str(token.resolve()) and a["url"] in status
    local = run_cli("ask", str(calibrated), *ASK).stdout
    assert run_cli("ask", "--server", str(run_dir), *ASK).stdout == local
    # without the token the server refuses
    refused = run_cli("ask", "--server", a["url"], *ASK, check=False)
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr
    assert f"cancelled jobs {job}" in run_cli("cancel", str(run_dir)).stdout
    slurm_jobs.wait(job, deadline_s=60)
    assert not address.exists()  # the server left cleanly and took its address with it
    log = (slurm_jobs.workdir / "logs" / "served" / "serve.log").read_text()
    assert "serve: listening on" in log and "serve: stopped" in log, log
