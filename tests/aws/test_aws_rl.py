"""`submit.py rl --backend aws`: an RL run goes through the same AWS backend as a recipe run.

The launcher's own ``main`` starts the run against moto (host, code archive, send_command) from
the command line a user types; the test reads the sent command back from moto, runs exactly those
lines with ``sh`` as the SSM agent would, and follows the S3 mirror to the run's exit. The host ran
the local backend, and its RL run equals, bit for bit (``verify-resume``'s comparison), the same
flags run with ``--backend local`` here. ``status`` and ``logs`` read the mirrored record.

The launcher runs in this process only so that the backend's boto3 clients get the one answer
moto lacks (the SSM agent's registration, :func:`tests.aws.conftest.agent_online`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import boto3
import pytest
import yaml

from hobson.aws.clients import Clients
from hobson.aws.remote import RemoteRun
from hobson.launch import submit
from hobson.launch.backends.aws import AwsBackend
from hobson.records import RunPaths, read_run_json
from hobson.rl.verify_resume import compare_runs
from tests.aws.conftest import agent_online, make_config

RL = ["--algorithm", "ppo", "--updates", "2", "--max-new-tokens", "4", "--prompts-per-update", "2",
      "--completions-per-prompt", "2", "--trainer", "torch", "--device", "cpu"]


@pytest.fixture
def launcher(aws_env, repo_copy, monkeypatch, capsys):
    """``main(argv) -> (exit code, stdout)``: submit.py in this process, run from the committed
    copy, its AWS backend's clients answering the agent's registration."""
    clients = Clients()
    agent_online(clients)
    made = AwsBackend.from_options.__func__

    def from_options(cls, options):
        be = made(cls, options)
        be.runner.clients = clients
        be.runner.repo = be.repo = repo_copy
        return be

    monkeypatch.setattr(AwsBackend, "from_options", classmethod(from_options))
    monkeypatch.chdir(repo_copy)

    def main(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = submit.main(list(argv))
        return code, capsys.readouterr().out

    return main


@pytest.mark.slow
def test_rl_on_the_aws_backend_runs_on_the_host_and_equals_a_local_run(aws_env, repo_copy, tmp_path, launcher,
                                                                      subprocess_env):
    """Slow (~40 s on 2 cores): two tiny PPO runs (the host's and the local reference) of two
    updates each, and the host's start from the code archive."""
    host_home = tmp_path / "host-disk" / "hobson"
    cfg = make_config(home=host_home)
    cfg_file = tmp_path / "aws.yaml"
    cfg_file.write_text(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg)))))
    run_dir = tmp_path / "local" / "runs" / "aws-rl"
    code, out = launcher("rl", "--backend", "aws", "--aws-config", str(cfg_file), "--detach", "--run-dir",
                         str(run_dir), "--logs-dir", str(tmp_path / "local" / "logs"), *RL)
    assert code == 0, out
    remote = RemoteRun.from_dict(read_run_json(RunPaths.attach(run_dir))["aws"])
    assert remote.argv[:3] == ["rl", "--ngpu", "1"] and "--detach" not in remote.argv, remote.argv

    ssm = boto3.client("ssm")
    (sent,) = ssm.list_commands(CommandId=remote.commands[0]["command_id"])["Commands"]
    script = "\n".join(sent["Parameters"]["commands"]) + "\n"
    assert "launch/submit.py rl --ngpu 1" in script and "--backend local" in script
    host_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp"), **aws_env}
    (tmp_path / "tmp").mkdir()
    (tmp_path / "script.sh").write_text(script)
    pid_file = host_home / "runs" / f"{run_dir.name}.hostrun.pid"
    local = tmp_path / "plain" / "runs" / "r"
    try:
        proc = subprocess.run(["sh", str(tmp_path / "script.sh")], cwd=tmp_path, env=host_env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # the reference, the same flags on the local backend, while the host runs (the machine is small)
        ref = subprocess.run([sys.executable, "launch/submit.py", "rl", "--backend", "local", "--run-dir", str(local),
                              "--logs-dir", str(tmp_path / "plain" / "logs"), *RL], cwd=repo_copy,
                             env=subprocess_env, capture_output=True, text=True, timeout=600)
        assert ref.returncode == 0, ref.stdout + ref.stderr
        s3 = boto3.client("s3")
        key = f"runs/{run_dir.name}/_host/exit.json"
        t0 = time.monotonic()
        while not s3.list_objects_v2(Bucket=cfg.bucket, Prefix=key).get("KeyCount"):
            assert time.monotonic() - t0 < 300, "the host's run wrote no exit.json within 300 s"
            time.sleep(0.5)
    finally:
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass

    code, out = launcher("status", str(run_dir))
    assert code == 0 and "ended, exit 0" in out, out
    # the host ran the RL job's components as processes (the local backend): both shown, both ok
    comps = {cols[1]: cols for line in out.splitlines() if line.startswith("rl ") and len(cols := line.split()) > 4}
    assert comps["training"][4] == "ok" and comps["rollout"][4] == "ok", out
    code, out = launcher("logs", str(run_dir), "rl")
    assert code == 0 and "2/2" in out, out[-2000:]
    host_rl = host_home / "runs" / run_dir.name / "rl"
    assert (host_rl / "checkpoints").is_dir() and (local / "rl" / "checkpoints").is_dir()
    items = compare_runs(local / "rl", host_rl)
    assert len(items) >= 10 and [i.line() for i in items if i.difference] == [], [i.line() for i in items]
