"""Polling ``get_command_invocation``: backoff, InvocationDoesNotExist, and every final state.

moto creates a command's invocation synchronously inside ``send_command`` and always reports
``Success`` (see ``moto/ssm/models.py``), so it can produce neither the early
``InvocationDoesNotExist`` of the real service nor ``Failed``/``TimedOut``/``Cancelled``. Those
answers come from botocore's ``Stubber`` on a real SSM client, and only here; the Success path
and the S3 output location are exercised against moto (here and in test_aws_payload_e2e.py).
"""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber

from hobson.aws import commands
from hobson.aws.clients import Clients
from hobson.aws.host import wait_online
from hobson.aws.options import PollOptions
from hobson.errors import HobsonError
from tests.aws.conftest import make_config

CID, IID = "0b6f6c3e-1111-2222-3333-444455556666", "i-0123456789abcdef0"
POLL = PollOptions(initial_s=1.0, max_s=4.0, factor=2.0, not_found_s=30.0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    def __call__(self) -> float:
        return self.t


def _invocation(status: str, code: int = -1, details: str | None = None) -> dict:
    return {"CommandId": CID, "InstanceId": IID, "Status": status, "StatusDetails": details or status,
            "ResponseCode": code}


def _stubbed(answers: list) -> tuple:
    ssm = boto3.client("ssm", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(ssm)
    for a in answers:
        if isinstance(a, str):
            stub.add_client_error("get_command_invocation", service_error_code=a, http_status_code=400,
                                  expected_params={"CommandId": CID, "InstanceId": IID})
        else:
            stub.add_response("get_command_invocation", a, {"CommandId": CID, "InstanceId": IID})
    stub.activate()
    return ssm, stub


@pytest.mark.parametrize("final,code,details", [
    ("Failed", 1, "Failed"),
    ("TimedOut", -1, "ExecutionTimedOut"),
    ("Cancelled", -1, "Cancelled"),
])
def test_final_states_after_invocation_does_not_exist_are_reported_with_s3_output(final, code, details):
    ssm, stub = _stubbed(["InvocationDoesNotExist", "InvocationDoesNotExist", _invocation("Pending"),
                          _invocation("InProgress"), _invocation("InProgress"), _invocation(final, code, details)])
    clock = FakeClock()
    res = commands.wait_command(ssm, CID, IID, POLL, bucket="hobson-b", prefix="ssm-output", sleep=clock.sleep,
                                clock=clock)
    stub.assert_no_pending_responses()
    assert clock.sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]  # doubling, capped at max_s
    assert (res.status, res.status_details, res.ok) == (final, details, False)
    assert res.response_code == (None if code == -1 else code)
    where = f"s3://hobson-b/ssm-output/{CID}/{IID}/awsrunShellScript/0.awsrunshellscript/"
    assert res.output_s3 == where
    assert res.describe() == (f"command {CID} on {IID}: {final} ({details}, exit {res.response_code}); "
                              f"output: {where}stdout and {where}stderr")


def test_invocation_that_never_appears_is_an_error_naming_the_wait():
    ssm, stub = _stubbed(["InvocationDoesNotExist"] * 7)  # t = 0..6 s
    clock = FakeClock()
    with pytest.raises(HobsonError, match=f"command {CID} on {IID}: SSM reports no invocation after 5s"):
        commands.wait_command(ssm, CID, IID, PollOptions(initial_s=1, max_s=1, not_found_s=5), bucket="b",
                              prefix="p", sleep=clock.sleep, clock=clock)
    stub.assert_no_pending_responses()


def test_other_errors_are_not_retried():
    ssm, _ = _stubbed(["InvalidCommandId"])
    with pytest.raises(Exception, match="InvalidCommandId"):
        commands.wait_command(ssm, CID, IID, POLL, bucket="b", prefix="p", sleep=lambda s: None)


def test_success_against_moto_and_output_read_from_s3_not_inline(aws_env):
    """The real round trip: send_command with an S3 output location, poll, read the stderr from S3."""
    cfg = make_config()
    clients = Clients()
    s3, ssm = clients("s3", "us-east-1"), clients("ssm", "us-east-1")
    s3.create_bucket(Bucket=cfg.bucket)
    ec2 = clients("ec2", "us-east-1")
    ami = ssm.get_parameter(Name=cfg.ami.ssm_parameter)["Parameter"]["Value"]
    iid = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    cid = commands.send_shell(ssm, iid, ["echo hi"], cfg, cfg.bucket, "us-east-1", "hobson test")
    res = commands.wait_command(ssm, cid, iid, cfg.poll, bucket=cfg.bucket, prefix=cfg.output_prefix)
    assert res.ok and res.response_code == 0
    # the agent would write here; a long stderr is read from its end, never from the inline 24,000 chars
    key = res.output_s3.removeprefix(f"s3://{cfg.bucket}/") + "stderr"
    s3.put_object(Bucket=cfg.bucket, Key=key, Body=b"x" * 30000 + b"\nthe real error\n")
    tail = commands.read_output(s3, res, max_bytes=100)
    assert tail.endswith("the real error\n") and len(tail) == 100
    assert commands.read_output(s3, res, "stdout") == ""


def test_wait_online_waits_for_the_agent_and_gives_up_at_the_deadline():
    ssm = boto3.client("ssm", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(ssm)
    flt = {"Filters": [{"Key": "InstanceIds", "Values": [IID]}]}
    stub.add_response("describe_instance_information", {"InstanceInformationList": []}, flt)
    stub.add_response("describe_instance_information",
                      {"InstanceInformationList": [{"InstanceId": IID, "PingStatus": "ConnectionLost"}]}, flt)
    stub.add_response("describe_instance_information",
                      {"InstanceInformationList": [{"InstanceId": IID, "PingStatus": "Online"}]}, flt)
    stub.activate()
    clock, said = FakeClock(), []
    wait_online(ssm, IID, 60, sleep=clock.sleep, clock=clock, echo=said.append)
    assert clock.sleeps == [2.0, 4.0]
    assert said == [f"[aws] {IID}: SSM agent not registered; waiting",
                    f"[aws] {IID}: SSM agent ConnectionLost; waiting"]
    for _ in range(4):
        stub.add_response("describe_instance_information", {"InstanceInformationList": []}, flt)
    with pytest.raises(HobsonError, match=f"{IID} did not report Online to SSM within 10s"):
        wait_online(ssm, IID, 10, sleep=clock.sleep, clock=clock, echo=said.append)
