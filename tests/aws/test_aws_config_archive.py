"""configs/aws.yaml validation, the code archive and its dirty-tree rule, host_setup.sh, dry-run."""

from __future__ import annotations

import subprocess
import sys
import tarfile

import pytest

from hobson.aws import codesync
from hobson.aws.options import DEFAULT_AWS_CONFIG, AwsConfig
from hobson.config import load_config
from hobson.errors import ConfigError, HobsonError
from hobson.io import sha256_file
from hobson.launch.backends.aws import AwsBackend
from hobson.records import RunPaths
from tests.aws.conftest import make_config
from tests.conftest import REPO

GIT = ["-c", "user.email=t@example.com", "-c", "user.name=test", "-c", "commit.gpgsign=false"]


def test_shipped_config_loads_and_unknown_keys_are_named_with_file_and_line(tmp_path):
    cfg = load_config(DEFAULT_AWS_CONFIG, AwsConfig)
    assert cfg.instance_types[0].type == "p5.48xlarge" and cfg.instance_types[0].gpus == 8
    assert cfg.ami.ssm_parameter.startswith("/aws/service/deeplearning/") and cfg.host.venv
    p = tmp_path / "aws.yaml"
    p.write_text("regions: [us-east-1]\nregoins: [x]\npoll:\n  intial_s: 2\nhost:\n  hme: /x\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, AwsConfig)
    msg = str(e.value)
    assert f"{p}:2: unknown key 'regoins'" in msg
    assert f"{p}:4: unknown key 'poll.intial_s'" in msg and f"{p}:6: unknown key 'host.hme'" in msg
    p.write_text("instance_types:\n  - {type: p5.48xlarge, gpu: 8}\n")
    with pytest.raises(ConfigError, match="unknown key 'gpu'"):
        load_config(p, AwsConfig)
    p.write_text("execution_timeout_s: 0\n")
    with pytest.raises(ConfigError, match=r"'execution_timeout_s' must be \[1, 172800\], got 0"):
        load_config(p, AwsConfig)
    p.write_text("ami: {id: null, ssm_parameter: null}\n")
    with pytest.raises(ConfigError, match="ami: set either id or ssm_parameter"):
        load_config(p, AwsConfig)


def _repo(tmp_path):
    r = tmp_path / "r"
    (r / "pkg").mkdir(parents=True)
    (r / "pkg" / "a.py").write_text("A = 1\n")
    (r / "pkg" / "gone.py").write_text("G = 1\n")
    (r / ".gitignore").write_text("ignored/\n")
    subprocess.run(["git", "init", "-q", str(r)], check=True)
    subprocess.run(["git", "-C", str(r), *GIT, "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(r), *GIT, "commit", "-q", "-m", "one"], check=True)
    return r


def _members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


def test_archive_is_deterministic_and_a_dirty_tree_is_refused_unless_allowed(tmp_path):
    r = _repo(tmp_path)
    a1 = codesync.make_archive(r, tmp_path / "1.tar.gz")
    a2 = codesync.make_archive(r, tmp_path / "2.tar.gz")
    assert a1.sha256 == a2.sha256 == sha256_file(tmp_path / "1.tar.gz") and not a1.dirty
    assert a1.files == 3 and set(_members(tmp_path / "1.tar.gz")) == {".gitignore", "pkg/a.py", "pkg/gone.py"}

    (r / "pkg" / "a.py").write_text("A = 2\n")
    (r / "pkg" / "gone.py").unlink()
    (r / "pkg" / "new.py").write_text("N = 1\n")
    (r / "ignored").mkdir()
    (r / "ignored" / "x").write_text("no\n")
    with pytest.raises(HobsonError, match=r"working tree differs from \w{12} \(3 paths, e.g. pkg/a.py, pkg/new.py, "
                                          r"pkg/gone.py\); commit it, or pass --allow-dirty"):
        codesync.make_archive(r, tmp_path / "3.tar.gz")
    a3 = codesync.make_archive(r, tmp_path / "3.tar.gz", allow_dirty=True)
    files = _members(tmp_path / "3.tar.gz")
    assert a3.dirty and a3.revision == a1.revision and a3.files == 3
    assert files["pkg/a.py"] == b"A = 2\n" and files["pkg/new.py"] == b"N = 1\n"
    assert "pkg/gone.py" not in files and "ignored/x" not in files
    assert b"-A = 1\n+A = 2" in files[".hobson/dirty.diff"]
    assert a3.manifest()["diff_sha256"] == codesync.sha256_bytes(files[".hobson/dirty.diff"])


def test_host_setup_parses_checks_versions_and_is_idempotent(tmp_path):
    script = REPO / "aws" / "host_setup.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    home = tmp_path / "home"
    outs = []
    for extra in ([], ["--no-check"]):  # the first run ends with the version check, as on a host
        p = subprocess.run(["bash", str(script), "--home", str(home), "--python", sys.executable, "--no-venv", *extra],
                           cwd=REPO, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        outs.append((home / "env.sh").read_text())
        if not extra:
            assert f"[host] python {sys.version.split()[0]}" in p.stdout
            assert "[host] torch " in p.stdout and "[host] GPU count: 0" in p.stdout
    assert outs[0] == outs[1] and f"export HF_HOME='{home}/hf-cache'" in outs[0]
    assert sorted(x.name for x in home.iterdir()) == ["code", "env.sh", "hf-cache", "logs", "runs", "tmp"]
    bad = subprocess.run(["bash", str(script), "--hmoe", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option --hmoe" in bad.stderr


def test_dry_run_prints_every_call_and_the_host_command_and_calls_nothing(tmp_path, monkeypatch, repo_copy):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: any real call would fail
    cfg = make_config(home="/opt/dlami/nvme/hobson")
    be = AwsBackend(cfg, 8, repo=repo_copy)
    text = be.dry_run(["recipe", "all", "--ngpu", "8"], RunPaths.create(tmp_path / "runs" / "r-dry"))
    calls = [ln.split()[1] for ln in text.splitlines() if ln.startswith("aws ")]
    for op in ("s3.create_bucket", "s3.put_bucket_encryption", "s3.put_public_access_block", "iam.create_role",
               "iam.attach_role_policy", "iam.put_role_policy", "iam.create_instance_profile",
               "ec2.create_security_group", "ssm.get_parameter", "ec2.run_instances", "s3.put_object",
               "ssm.describe_instance_information", "ssm.send_command", "ssm.get_command_invocation"):
        assert op in calls, op
    assert calls.index("ec2.run_instances") < calls.index("ssm.send_command")
    assert '"InstanceInitiatedShutdownBehavior": "terminate"' in text and "shutdown -h +720" in text
    assert '"executionTimeout": ["3600"]' in text
    host = text.split("# the host command (AWS-RunShellScript commands, one per line):\n")[1]
    assert "nohup setsid" in host and "launch/submit.py recipe all --ngpu 8 --backend local --run-dir " \
                                      "/opt/dlami/nvme/hobson/runs/r-dry" in host
    assert be.runner.clients._cache == {}  # the backend never made a real client


def test_runner_cli_dry_run(tmp_path):
    p = subprocess.run([sys.executable, "-m", "aws.runner", "run", "--dry-run", "--ngpu", "4", "--run-dir",
                        str(tmp_path / "runs" / "x"), "--", "recipe", "build"], cwd=REPO, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert "aws ec2.run_instances [us-east-1]" in p.stdout and '"InstanceType": "p5.48xlarge"' in p.stdout
    assert "launch/submit.py recipe build --ngpu 4 --backend local" in p.stdout
    assert not (tmp_path / "runs" / "x").exists()  # a dry run writes no record


def test_config_dir_outside_repo_is_refused_for_remote_runs(tmp_path):
    import argparse

    from hobson.launch.submit import recipe_argv

    ns = argparse.Namespace(stages=["build"], ngpu=2, config=REPO / "configs" / "recipe.yaml", seed=3, scale=None,
                            teacher=None)
    assert recipe_argv(ns) == ["recipe", "build", "--ngpu", "2", "--config", "configs/recipe.yaml", "--seed", "3"]
    ns.config = tmp_path / "mine.yaml"
    with pytest.raises(HobsonError, match="is outside the repository"):
        recipe_argv(ns)

