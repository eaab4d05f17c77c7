"""cancel: the command sent through moto, run against a detached aws.hostrun, stops the run and is mirrored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import boto3

from hobson.aws.clients import Clients
from hobson.aws.remote import RemoteRun
from hobson.launch.backends.aws import AwsBackend
from hobson.records import RunPaths, new_run_json, write_run_json
from tests.aws.conftest import make_config
from tests.conftest import REPO

# A launcher stand-in that, like the local backend, turns SIGTERM into exit 143.
CHILD = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); time.sleep(60)"


def test_cancel_command_stops_the_detached_run_and_the_exit_is_mirrored(aws_env, tmp_path):
    home = tmp_path / "host" / "hobson"
    cfg = make_config(home=home)
    clients = Clients()
    s3 = clients("s3", "us-east-1")
    s3.create_bucket(Bucket=cfg.bucket)
    ami = clients("ssm", "us-east-1").get_parameter(Name=cfg.ami.ssm_parameter)["Parameter"]["Value"]
    iid = clients("ec2", "us-east-1").run_instances(ImageId=ami, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    run_id = "c1"
    (home / "runs").mkdir(parents=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **aws_env}
    hostrun = subprocess.Popen(
        [sys.executable, "-m", "aws.hostrun", "--bucket", cfg.bucket, "--prefix", f"runs/{run_id}", "--run-dir",
         str(home / "runs" / run_id), "--logs-dir", str(home / "logs" / run_id), "--interval", "1", "--poll", "0.2",
         "--", "-c", CHILD], cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    (home / "runs" / f"{run_id}.hostrun.pid").write_text(f"{hostrun.pid}\n")
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket=cfg.bucket, Prefix=f"runs/{run_id}/").get(
                "Contents", [])]
            if f"runs/{run_id}/_host/started.json" in keys:
                break
            time.sleep(0.2)
        paths = RunPaths.create(tmp_path / "local" / run_id, tmp_path / "local-logs")
        paths.run_dir.mkdir(parents=True)
        meta = new_run_json(paths, argv=["t"], backend="aws", options={}, config_digests={})
        remote = RemoteRun(run_id=run_id, bucket=cfg.bucket, bucket_region="us-east-1", instance_id=iid,
                           region="us-east-1", instance_type="t3.micro", launched=False, host_home=str(home),
                           argv=["recipe", "build"])
        meta["aws"] = asdict(remote)
        write_run_json(paths, meta)
        backend = AwsBackend(cfg, clients=clients, echo=lambda s: None)
        assert "running" in backend.status(paths)

        said = backend.cancel(paths)
        assert said.startswith(f"cancel sent to {iid}: command ") and "Success" in said
        cid = json.loads(paths.run_json.read_text())["aws"]["commands"][-1]["command_id"]
        (sent,) = boto3.client("ssm").list_commands(CommandId=cid)["Commands"]
        assert sent["Parameters"]["executionTimeout"] == [str(cfg.execution_timeout_s)]
        p = subprocess.run(["sh", "-c", "\n".join(sent["Parameters"]["commands"])], env=env, capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 0 and f"sent SIGTERM to run {run_id} (pid {hostrun.pid})" in p.stdout, p.stderr
        out, _ = hostrun.communicate(timeout=30)
        assert hostrun.returncode == 143, out
        assert "[hostrun] run ended: exit 143 (cancelled)" in out
        status = backend.status(paths)
        assert "ended, exit 143 (cancelled)" in status
        assert json.loads((paths.run_dir / "host" / "exit.json").read_text())["cancelled"] is True
        again = subprocess.run(["sh", "-c", "\n".join(sent["Parameters"]["commands"])], env=env,
                               capture_output=True, text=True, timeout=30)
        assert f"run {run_id} is not running on this host" in again.stdout
    finally:
        if hostrun.poll() is None:
            os.kill(hostrun.pid, signal.SIGKILL)
            hostrun.wait()
