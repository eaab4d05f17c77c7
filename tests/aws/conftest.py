"""A moto server on 127.0.0.1 (real boto3 over HTTP, fake credentials), and a committed copy of the tree.

moto 5.2.1 has no ``DescribeInstanceInformation`` (the SSM agent's registration) and never
answers a capacity error; :func:`answer` stands in for exactly those two responses with a
botocore ``before-call`` hook on one operation of a real client; every other call reaches moto.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hobson.aws.clients import Clients
from hobson.aws.options import AmiOptions, AwsConfig, HostOptions, InstanceChoice, PollOptions
from tests.conftest import REPO

# A public parameter moto serves, so the AMI lookup path is the real one.
AMI_PARAMETER = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
BUCKET = "hobson-test-runs"


@pytest.fixture(scope="session")
def moto_url():
    os.environ["MOTO_IAM_LOAD_MANAGED_POLICIES"] = "true"  # AmazonSSMManagedInstanceCore must exist
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def aws_env(moto_url, monkeypatch):
    """Fake credentials and the moto endpoint for every boto3 client.

    The server is shared by the session (a moto reset costs seconds of EC2 set-up per region);
    tests stay apart through names and tag values unique to each (:func:`make_config`).
    """
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CONFIG_FILE",
              "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**AWS_ENV, "AWS_ENDPOINT_URL": moto_url}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    return {**AWS_ENV, "AWS_ENDPOINT_URL": moto_url, "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}


def make_config(home: Path | str = "/opt/hobson-test", **over) -> AwsConfig:
    """A config whose bucket, role, security group and tag value no other test uses."""
    u = uuid.uuid4().hex[:8]
    cfg = AwsConfig(
        regions=["us-east-1"],
        instance_types=[InstanceChoice("p4d.24xlarge", 8)],
        ami=AmiOptions(id=None, ssm_parameter=AMI_PARAMETER),
        bucket=f"{BUCKET}-{u}",
        role_name=f"hobson-host-{u}",
        security_group=f"hobson-no-ingress-{u}",
        tag_value=f"test-{u}",
        mirror_interval_s=1,
        follow_interval_s=0.5,
        poll=PollOptions(initial_s=0.05, max_s=0.5, factor=2.0, not_found_s=5.0),
        host=HostOptions(home=str(home), python=sys.executable, venv=False, scratch_mount=None),
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


class _Resp:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code
        self.headers: dict = {}
        self.content = b""
        self.text = ""


def answer(clients: Clients, service: str, region: str, operation: str, fn) -> None:
    """Answer one operation of a real client: ``fn(params) -> dict`` (a response) or ``str`` (an error code).

    ``fn`` returning None lets the call through to moto.
    """
    client = clients(service, region)

    def hook(params, **kwargs):
        body = params.get("body") or b""
        if isinstance(body, bytes) and body.startswith(b"{"):
            req = json.loads(body)
        elif isinstance(body, dict):
            req = body
        else:
            from urllib.parse import parse_qs

            req = {k: v[0] for k, v in parse_qs(body.decode() if isinstance(body, bytes) else body).items()}
        out = fn(req)
        if out is None:
            return None
        if isinstance(out, str):
            return _Resp(400), {"Error": {"Code": out, "Message": f"{out} (answered by the test)"},
                                "ResponseMetadata": {"HTTPStatusCode": 400}}
        return _Resp(200), out

    client.meta.events.register(f"before-call.{client.meta.service_model.service_id.hyphenize()}.{operation}", hook)


def agent_online(clients: Clients, region: str = "us-east-1") -> None:
    """Stand-in for the SSM agent registering: every asked-for instance is Online."""
    answer(clients, "ssm", region, "DescribeInstanceInformation", lambda req: {"InstanceInformationList": [
        {"InstanceId": v, "PingStatus": "Online"} for f in req.get("Filters", []) for v in f["Values"]]})


@pytest.fixture(scope="session")
def repo_copy(tmp_path_factory) -> Path:
    """The working tree (tracked and untracked, not ignored) committed in a scratch repository.

    The archive under test is then a clean ``git archive HEAD`` whatever the state of the real
    checkout; no git command touches the real repository's state.
    """
    dst = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    git = ["git", "-C", str(dst), "-c", "user.email=t@example.com", "-c", "user.name=test",
           "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(dst)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "snapshot"], check=True)
    return dst
