"""Infrastructure, host launch, capacity fallback, reuse and teardown against a moto server."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import boto3
import pytest

from hobson.aws import host, infra
from hobson.aws.clients import Clients
from hobson.aws.options import InstanceChoice
from hobson.aws.remote import RemoteRun, Runner
from hobson.errors import HobsonError
from tests.aws.conftest import agent_online, answer, make_config
from tests.conftest import REPO


def test_infrastructure_is_created_once_with_encryption_no_public_access_and_bucket_only_policy(aws_env):
    cfg = make_config()
    runner = Runner(cfg, echo=lambda s: None)
    first = runner.ensure_infra()
    bucket = cfg.bucket
    assert first.created and first.bucket == bucket
    assert runner.ensure_infra().created == []  # second call: nothing new

    s3 = boto3.client("s3")
    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    assert s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"] == infra.PUBLIC_BLOCK

    iam = boto3.client("iam")
    role = cfg.role_name
    trust = iam.get_role(RoleName=role)["Role"]["AssumeRolePolicyDocument"]
    assert trust["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    assert [p["PolicyArn"] for p in iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]] == [
        infra.SSM_CORE]
    doc = iam.get_role_policy(RoleName=role, PolicyName=infra.BUCKET_POLICY_NAME)["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    resources = {r for st in doc["Statement"] for r in ([st["Resource"]] if isinstance(st["Resource"], str)
                                                        else st["Resource"])}
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}
    prof = iam.get_instance_profile(InstanceProfileName=role)["InstanceProfile"]
    assert [r["RoleName"] for r in prof["Roles"]] == [role]

    ec2 = boto3.client("ec2")
    created: list[str] = []
    gid = infra.ensure_security_group(ec2, cfg.security_group, "us-east-1", {"hobson:managed": "true"}, created)
    assert len(created) == 1
    assert infra.ensure_security_group(ec2, cfg.security_group, "us-east-1", {}, created) == gid
    assert len(created) == 1
    assert ec2.describe_security_groups(GroupIds=[gid])["SecurityGroups"][0]["IpPermissions"] == []


def test_security_group_with_ingress_is_refused(aws_env):
    ec2 = boto3.client("ec2")
    vpc = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    name = make_config().security_group
    gid = ec2.create_security_group(GroupName=name, Description="x", VpcId=vpc)["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=gid, IpPermissions=[
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}])
    with pytest.raises(HobsonError, match=f"security group {name} \\({gid}, us-east-1\\) has ingress rules"):
        infra.ensure_security_group(ec2, name, "us-east-1", {}, [])


def test_host_is_launched_tagged_with_safety_shutdown_and_reused(aws_env):
    cfg = make_config()
    clients = Clients()
    runner = Runner(cfg, clients, echo=lambda s: None)
    inf = runner.ensure_infra()
    h = runner.acquire_host(inf, "run-1", ngpu=8)
    assert h.launched and h.instance_type == "p4d.24xlarge" and h.region == "us-east-1"
    ec2 = boto3.client("ec2")
    inst = ec2.describe_instances(InstanceIds=[h.instance_id])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags["hobson:managed"] == cfg.tag_value and tags["hobson:run"] == "run-1"
    assert inst["IamInstanceProfile"]["Arn"].endswith(f"instance-profile/{cfg.role_name}")
    assert [g["GroupId"] for g in inst["SecurityGroups"]] == [inf.security_groups["us-east-1"]]
    ami = boto3.client("ssm").get_parameter(Name=cfg.ami.ssm_parameter)["Parameter"]["Value"]
    assert inst["ImageId"] == ami
    ud = ec2.describe_instance_attribute(InstanceId=h.instance_id, Attribute="userData")["UserData"]["Value"]
    assert f"shutdown -h +{cfg.safety_shutdown_minutes}" in base64.b64decode(ud).decode()
    beh = ec2.describe_instance_attribute(InstanceId=h.instance_id, Attribute="instanceInitiatedShutdownBehavior")
    assert beh["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"

    cfg.terminate_after_run = False
    second = runner.acquire_host(inf, "run-2", ngpu=8)  # the first is busy with run-1: a new host
    assert second.launched and second.instance_id != h.instance_id
    remote = RemoteRun(run_id="run-1", bucket=inf.bucket, bucket_region="us-east-1", instance_id=h.instance_id,
                       region="us-east-1", instance_type=h.instance_type, launched=True, host_home="/x", argv=[])
    assert runner.release(remote) == []  # kept, idle
    again = runner.acquire_host(inf, "run-3", ngpu=8)  # running, idle, tagged, timer far away: reused
    assert again.instance_id == h.instance_id and not again.launched
    tags = {t["Key"]: t["Value"] for t in ec2.describe_instances(InstanceIds=[h.instance_id])["Reservations"][0][
        "Instances"][0]["Tags"]}
    assert tags["hobson:state"] == "busy" and tags["hobson:run"] == "run-3"
    agent_online(clients)
    host.wait_online(clients("ssm", "us-east-1"), h.instance_id, 5, sleep=lambda s: None, echo=lambda s: None)


def test_capacity_fallback_tries_every_zone_and_region_then_the_next_type(aws_env):
    """moto never runs out of capacity: RunInstances for p5.48xlarge is answered with
    InsufficientInstanceCapacity by a hook on the real client; the p4d launch reaches moto."""
    cfg = make_config(regions=["us-east-1", "us-west-2"],
                      instance_types=[InstanceChoice("g6e.12xlarge", 4), InstanceChoice("p5.48xlarge", 8),
                                      InstanceChoice("p4d.24xlarge", 8)])
    clients = Clients()
    tried: list[str] = []
    for region in cfg.regions:
        def full(req, region=region):
            tried.append(f"{req['InstanceType']}@{region}")
            return "InsufficientInstanceCapacity" if req["InstanceType"] == "p5.48xlarge" else None
        answer(clients, "ec2", region, "RunInstances", full)
    lines: list[str] = []
    runner = Runner(cfg, clients, echo=lines.append)
    h = runner.acquire_host(runner.ensure_infra(), "run-cap", ngpu=8)
    assert (h.instance_type, h.region, h.launched) == ("p4d.24xlarge", "us-east-1", True)
    assert "g6e.12xlarge@us-east-1" not in tried  # 4 GPUs < --ngpu 8: never tried
    p5_east = [t for t in tried if t == "p5.48xlarge@us-east-1"]
    p5_west = [t for t in tried if t == "p5.48xlarge@us-west-2"]
    assert len(p5_east) >= 2 and len(p5_west) >= 2  # each offering zone, in both regions
    assert tried.index("p4d.24xlarge@us-east-1") == len(tried) - 1
    assert sum("InsufficientInstanceCapacity; next" in ln for ln in lines) == len(p5_east) + len(p5_west)
    ec2 = boto3.client("ec2", region_name="us-west-2")  # the west security group was created on the way
    assert ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [cfg.security_group]}])[
        "SecurityGroups"]


def test_no_capacity_anywhere_names_every_attempt(aws_env):
    cfg = make_config()
    clients = Clients()
    answer(clients, "ec2", "us-east-1", "RunInstances", lambda req: "InsufficientInstanceCapacity")
    runner = Runner(cfg, clients, echo=lambda s: None)
    with pytest.raises(HobsonError, match=r"no capacity for any listed instance type and region:\n"
                                          r"  p4d.24xlarge in us-east-1\w: InsufficientInstanceCapacity"):
        runner.acquire_host(runner.ensure_infra(), "run-x", ngpu=8)
    with pytest.raises(HobsonError, match="no instance type in configs/aws.yaml has 16 GPUs"):
        host.candidates(cfg, 16)


def test_teardown_terminates_only_tagged_hosts(aws_env, tmp_path):
    cfg = make_config()
    runner = Runner(cfg, echo=lambda s: None)
    inf = runner.ensure_infra()
    ours = runner.acquire_host(inf, "run-a", ngpu=8).instance_id
    cfg.reuse_host = False
    other_run = runner.acquire_host(inf, "run-b", ngpu=8).instance_id
    ec2 = boto3.client("ec2")
    ami = boto3.client("ssm").get_parameter(Name=cfg.ami.ssm_parameter)["Parameter"]["Value"]
    untagged = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="t3.micro")["Instances"][0][
        "InstanceId"]
    foreign = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="t3.micro", TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "hobson:managed", "Value": "true"}]}])["Instances"][0]
    foreign = foreign["InstanceId"]  # tagged by someone else's config (another tag value): not ours

    def state(i):
        return ec2.describe_instances(InstanceIds=[i])["Reservations"][0]["Instances"][0]["State"]["Name"]

    assert host.terminate(runner.clients, cfg, "us-east-1", [untagged]) == []  # refused: not ours
    assert runner.teardown(run_id="run-a") == {"us-east-1": [ours]}
    assert state(ours) == "terminated" and state(other_run) == "running"

    cfg_file = tmp_path / "aws.yaml"
    cfg_file.write_text(f"bucket: {cfg.bucket}\nregions: [us-east-1]\ntag_value: {cfg.tag_value}\n")
    proc = subprocess.run([str(REPO / "aws" / "teardown"), "--config", str(cfg_file)], capture_output=True, text=True,
                          env={**aws_env, "PATH": "/usr/bin:/bin:" + str(REPO.parent), "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    assert f"us-east-1: terminated {other_run}" in proc.stdout
    assert state(other_run) == "terminated"
    assert state(untagged) == "running" and state(foreign) == "running"
