"""The start command as sent, executed in a local shell against a directory standing in for the host.

The runner starts a run against moto (infrastructure, host, code archive, send_command). The
test then reads the command back from moto's record of the request (``list_commands``), runs
exactly those lines with ``sh`` (as the SSM agent does) with ``AWS_ENDPOINT_URL`` pointing at
moto, and follows the run through its S3 mirror: the detached recipe must produce the same
outputs as a ``--backend local`` run, and the mirror must hold ``stages.jsonl`` and the logs
after each stage. Only ``DescribeInstanceInformation`` is answered by the test (moto lacks it).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import boto3
import pytest

from hobson import faults
from hobson.aws.clients import Clients
from hobson.aws.remote import RemoteRun
from hobson.launch.backends.aws import AwsBackend
from hobson.records import RunPaths, new_run_json, read_run_json, read_stage_records, write_run_json
from tests.aws.conftest import agent_online, make_config
from tests.conftest import REPO

STAGES = ["build", "multistep"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _kill_leftover(pid_file) -> None:
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass


@pytest.mark.slow
def test_sent_payload_runs_detached_mirrors_each_stage_and_matches_a_local_run(aws_env, repo_copy, tmp_path,
                                                                              subprocess_env):
    """Slow (15-30 s on 2 cores): the payload runs two real stages detached on the "host" while
    the same stages run on the local backend beside it for the byte comparison, and the test
    follows the S3 mirror (moto over HTTP) until the run's exit record arrives."""
    host_home = tmp_path / "host-disk" / "hobson"
    cfg = make_config(home=host_home)
    clients = Clients()
    agent_online(clients)
    lines: list[str] = []
    backend = AwsBackend(cfg, 1, clients=clients, echo=lines.append, repo=repo_copy, follow=False)
    run_id = "aws-e2e"
    paths = RunPaths.create(tmp_path / "local" / "runs" / run_id, tmp_path / "local" / "logs")
    paths.run_dir.mkdir(parents=True)
    write_run_json(paths, new_run_json(paths, argv=["test"], backend="aws", options={}, config_digests={}))
    argv = ["recipe", *STAGES, "--ngpu", "1"]

    assert backend.run(argv, paths) == 0  # started, detached (follow=False): the runner returns
    remote = RemoteRun.from_dict(read_run_json(paths)["aws"])
    assert remote.argv == argv and remote.launched and remote.code["revision"]

    # the code archive and its manifest, downloaded from moto's S3
    s3 = boto3.client("s3")
    archive = s3.get_object(Bucket=cfg.bucket, Key=f"code/{run_id}/code.tar.gz")["Body"].read()
    manifest = json.loads(s3.get_object(Bucket=cfg.bucket, Key=f"code/{run_id}/manifest.json")["Body"].read())
    head = subprocess.run(["git", "-C", str(repo_copy), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert manifest["sha256"] == _sha(archive) and manifest["revision"] == head.strip() and not manifest["dirty"]
    with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
        assert manifest["files"] == len(members)
        assert tf.extractfile("jobs/build.py").read() == (repo_copy / "jobs" / "build.py").read_bytes()

    # the command exactly as moto recorded the request
    ssm = boto3.client("ssm")
    (sent,) = ssm.list_commands(CommandId=remote.commands[0]["command_id"])["Commands"]
    # (moto 5.2.1 adds every instance of the region to a command sent without Targets: `in`, not `==`)
    assert sent["DocumentName"] == "AWS-RunShellScript" and remote.instance_id in sent["InstanceIds"]
    assert sent["Parameters"]["executionTimeout"] == [str(cfg.execution_timeout_s)]
    assert (sent["OutputS3BucketName"], sent["OutputS3KeyPrefix"]) == (cfg.bucket, cfg.output_prefix)
    payload = sent["Parameters"]["commands"]
    script = "\n".join(payload) + "\n"
    assert manifest["sha256"] in script and "nohup setsid" in script
    assert remote.commands[0]["status"] == "Success"  # moto's answer, polled through get_command_invocation

    # run it as the agent would: sh, from a scratch directory, with the host's environment
    # PATH without the aws CLI (and anything else pip installed): the payload fetches the archive with its
    # python boto3 fallback, the same way on every machine that runs this test
    host_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp"), **aws_env}
    # the second stage holds before it starts until the test has seen the mirror after the first
    # (a data stage takes ~0.3 s: the snapshot must not depend on the machine being slow)
    holds = tmp_path / "holds"
    host_env.update({faults.ENV_POINTS: f"stage-{STAGES[1]}", faults.ENV_DIR: str(holds)})
    (tmp_path / "tmp").mkdir()
    (tmp_path / "script.sh").write_text(script)
    pid_file = host_home / "runs" / f"{run_id}.hostrun.pid"
    # the reference: the same stages on the local backend, run meanwhile (the machine is small)
    local = tmp_path / "plain"
    reference = subprocess.Popen(
        [sys.executable, str(REPO / "launch" / "submit.py"), "recipe", *STAGES, "--backend", "local", "--ngpu", "1",
         "--run-dir", str(local / "runs" / "r"), "--logs-dir", str(local / "logs")],
        cwd=repo_copy, env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(["sh", str(tmp_path / "script.sh")], cwd=tmp_path, env=host_env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"hobson: run {run_id} started" in proc.stdout
        assert "[host] GPU count: 0" in proc.stdout  # host_setup's check ran
        started = int(pid_file.read_text())
        os.kill(started, 0)  # the command returned; the run goes on detached

        # follow the mirror: snapshots of what S3 holds while the run goes on
        prefix = f"runs/{run_id}/"
        mid_run_status = None
        seen: list[tuple[int, bool, bool]] = []
        while time.monotonic() - t0 < 150:
            keys = {o["Key"][len(prefix):] for o in s3.list_objects_v2(Bucket=cfg.bucket, Prefix=prefix)
                    .get("Contents", [])}
            if "_host/exit.json" in keys:
                break
            if "stages.jsonl" in keys:
                n = len(s3.get_object(Bucket=cfg.bucket, Key=prefix + "stages.jsonl")["Body"].read().splitlines())
                seen.append((n, "logs/build.log" in keys, "data/build/train.jsonl" in keys))
                if n == 1 and mid_run_status is None:
                    mid_run_status = backend.status(paths)
                    assert [r["stage"] for r in read_stage_records(paths)] == ["build"]
                if seen[-1] == (1, True, True) and list(holds.glob(f"stage-{STAGES[1]}.held.*")):
                    faults.release(holds, f"stage-{STAGES[1]}")
            time.sleep(0.2)
        else:
            raise AssertionError(f"no exit.json after 150 s; seen {seen}")
    finally:
        _kill_leftover(pid_file)
        out, _ = reference.communicate(timeout=150)
    assert reference.returncode == 0, out
    # after the first stage, before the run ended: its record line, its log and its outputs
    assert any(n == 1 and log and out for n, log, out in seen), seen
    assert list(holds.glob(f"stage-{STAGES[1]}.held.*")) and (holds / f"stage-{STAGES[1]}.release").exists()
    assert mid_run_status and "running" in mid_run_status

    # the runner follows to the end through the mirror, fetches outputs, releases the host
    code = backend.finish(paths, interval=0.2, timeout_s=30)
    assert code == 0, "\n".join(lines)
    assert any(ln.startswith("[aws] build: ok in") for ln in lines)
    assert "ended, exit 0" in backend.status(paths)
    host_records = read_stage_records(RunPaths(host_home / "runs" / run_id, host_home / "logs" / run_id))
    assert paths.stages_jsonl.read_bytes() == (host_home / "runs" / run_id / "stages.jsonl").read_bytes()
    assert [r["stage"] for r in host_records] == STAGES
    host_log = host_home / "logs" / run_id / "multistep.log"
    assert (paths.logs_dir / "multistep.log").read_bytes() == host_log.read_bytes()
    assert {"build.log", "multistep.log", "launcher.log"} <= set(backend.logs(paths).split())
    assert "[hobson] stage build ok" in backend.logs(paths, "build")
    ec2 = boto3.client("ec2")
    inst = ec2.describe_instances(InstanceIds=[remote.instance_id])["Reservations"][0]["Instances"][0]
    assert inst["State"]["Name"] == "terminated"  # terminate_after_run

    # the same stages on the local backend gave the same bytes
    local_records = read_stage_records(RunPaths(local / "runs" / "r", local / "logs" / "r"))
    want = {o["path"]: o["sha256"] for r in local_records for o in r["outputs"]}
    got = {o["path"]: o["sha256"] for r in host_records for o in r["outputs"]}
    assert got == want and len(want) >= 6
    for rel, digest in want.items():  # and the fetched copies are those bytes
        assert _sha((paths.run_dir / rel).read_bytes()) == digest, rel
