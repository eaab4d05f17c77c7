"""One GPU host: find a reusable one, or launch one trying each instance type and region in order.

Launch order: each instance type (with at least ``ngpu`` GPUs) in every region before the next
type; within a region, each availability zone that offers the type. A capacity or "not offered
here" error moves on to the next candidate; any other error stops. The host boots with user
data that schedules ``shutdown -h +N`` and has shutdown behaviour ``terminate``, so a host the
runner forgets still dies. Only instances carrying the tool's tag are ever reused or terminated.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from botocore.exceptions import ClientError

from hobson.aws.clients import Clients, error_code
from hobson.aws.infra import Infra, ensure_security_group
from hobson.aws.options import AwsConfig
from hobson.errors import HobsonError

# Errors after which another type, zone or region may still work.
NEXT_CANDIDATE = {
    "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity", "Unsupported", "VcpuLimitExceeded", "InstanceLimitExceeded",
    "MaxSpotInstanceCountExceeded", "InvalidInstanceType.NotFound",
}
# A just-created instance profile takes a few seconds to be usable by EC2.
PROFILE_NOT_READY = "Invalid IAM Instance Profile"


@dataclass
class Host:
    instance_id: str
    region: str
    instance_type: str
    availability_zone: str
    launched: bool  # False when an existing tagged host was reused


def user_data(safety_minutes: int) -> str:
    return ("#!/bin/bash\n"
            "# hobson: a forgotten host powers off (and, by its shutdown behaviour, terminates)\n"
            f"shutdown -h +{safety_minutes} 'hobson safety shutdown'\n")


def candidates(cfg: AwsConfig, ngpu: int) -> list[tuple[str, str]]:
    """(instance type, region) in the order they are tried."""
    types = [c.type for c in cfg.instance_types if c.gpus >= ngpu]
    if not types:
        raise HobsonError(f"no instance type in configs/aws.yaml has {ngpu} GPUs: "
                          + ", ".join(f"{c.type} ({c.gpus})" for c in cfg.instance_types))
    return [(t, r) for t in types for r in cfg.regions]


def resolve_ami(ssm, cfg: AwsConfig) -> str:
    if cfg.ami.id:
        return cfg.ami.id
    return ssm.get_parameter(Name=cfg.ami.ssm_parameter)["Parameter"]["Value"]


def tag_filters(cfg: AwsConfig, run_id: str | None = None) -> list[dict]:
    f = [{"Name": f"tag:{cfg.tag_key}", "Values": [cfg.tag_value]}]
    if run_id:
        f.append({"Name": "tag:hobson:run", "Values": [run_id]})
    return f


def tagged_instances(ec2, cfg: AwsConfig, states: list[str], run_id: str | None = None) -> list[dict]:
    out = []
    resp = ec2.describe_instances(Filters=tag_filters(cfg, run_id)
                                  + [{"Name": "instance-state-name", "Values": states}])
    for res in resp.get("Reservations", []):
        out += res.get("Instances", [])
    return out


STATE_TAG = "hobson:state"  # busy while a run is on the host; idle once the runner released it


def set_state(clients: Clients, region: str, instance_id: str, state: str, run_id: str | None = None) -> None:
    tags = [{"Key": STATE_TAG, "Value": state}] + ([{"Key": "hobson:run", "Value": run_id}] if run_id else [])
    clients("ec2", region).create_tags(Resources=[instance_id], Tags=tags)


def find_reusable(clients: Clients, cfg: AwsConfig, ngpu: int, now: datetime | None = None) -> Host | None:
    """A running, idle, tagged host of a listed type whose safety timer leaves enough time.

    A host whose runner died mid-run stays "busy" and is never reused: its safety timer ends it.
    """
    now = now or datetime.now(timezone.utc)
    types = [t for t, _ in candidates(cfg, ngpu)]
    for region in cfg.regions:
        ec2 = clients("ec2", region)
        idle = ec2.describe_instances(Filters=tag_filters(cfg) + [
            {"Name": f"tag:{STATE_TAG}", "Values": ["idle"]}, {"Name": "instance-state-name", "Values": ["running"]}])
        for inst in [i for r in idle.get("Reservations", []) for i in r.get("Instances", [])]:
            launched = inst.get("LaunchTime")
            if isinstance(launched, datetime):
                left = cfg.safety_shutdown_minutes - (now - launched).total_seconds() / 60
                if left < cfg.min_remaining_minutes:
                    continue
            if inst.get("InstanceType") in types:
                return Host(inst["InstanceId"], region, inst["InstanceType"],
                            inst.get("Placement", {}).get("AvailabilityZone", "?"), launched=False)
    return None


def launch(clients: Clients, cfg: AwsConfig, infra: Infra, run_id: str, ngpu: int,
           echo: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> Host:
    tags = {cfg.tag_key: cfg.tag_value, "hobson:run": run_id, STATE_TAG: "busy", "Name": f"hobson-{run_id}"}
    tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
    attempts: list[str] = []
    amis: dict[str, str] = {}
    for itype, region in candidates(cfg, ngpu):
        ec2 = clients("ec2", region)
        offered = ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [itype]}])
        zones = sorted({o["Location"] for o in offered.get("InstanceTypeOfferings", [])})
        if not zones:
            attempts.append(f"{itype} in {region}: not offered")
            echo(f"[aws] {itype} is not offered in {region}; next")
            continue
        if region not in infra.security_groups:
            infra.security_groups[region] = ensure_security_group(
                ec2, cfg.security_group, region, {cfg.tag_key: cfg.tag_value}, infra.created)
        if region not in amis:
            amis[region] = resolve_ami(clients("ssm", region), cfg)
        subnets = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]},
                                                {"Name": "availability-zone", "Values": zones}]).get("Subnets", [])
        for subnet in sorted(subnets, key=lambda s: s["AvailabilityZone"]):
            az = subnet["AvailabilityZone"]
            try:
                inst = _run_instance(ec2, cfg, infra, region, itype, amis[region], subnet["SubnetId"], tag_list, sleep)
            except ClientError as e:
                code = error_code(e)
                if code not in NEXT_CANDIDATE:
                    raise HobsonError(f"launching {itype} in {az} failed ({code}): {e}; tried before: "
                                      + ("; ".join(attempts) or "nothing")) from None
                attempts.append(f"{itype} in {az}: {code}")
                echo(f"[aws] {itype} in {az}: {code}; next")
                continue
            echo(f"[aws] launched {inst['InstanceId']} ({itype}, {az})")
            return Host(inst["InstanceId"], region, itype, az, launched=True)
        if not subnets:
            attempts.append(f"{itype} in {region}: no default subnet in {', '.join(zones)}")
    raise HobsonError("no capacity for any listed instance type and region:\n  " + "\n  ".join(attempts)
                      + "\nadd types or regions to configs/aws.yaml, or try again later")


def _run_instance(ec2, cfg: AwsConfig, infra: Infra, region: str, itype: str, ami: str, subnet: str,
                  tag_list: list[dict], sleep: Callable[[float], None]) -> dict:
    kwargs = dict(
        ImageId=ami, InstanceType=itype, MinCount=1, MaxCount=1, SubnetId=subnet,
        SecurityGroupIds=[infra.security_groups[region]],
        IamInstanceProfile={"Name": infra.instance_profile},
        UserData=user_data(cfg.safety_shutdown_minutes),
        InstanceInitiatedShutdownBehavior="terminate",
        MetadataOptions={"HttpTokens": "required", "HttpEndpoint": "enabled"},
        BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {
            "VolumeSize": cfg.host.root_volume_gb, "VolumeType": "gp3", "DeleteOnTermination": True}}],
        TagSpecifications=[{"ResourceType": "instance", "Tags": tag_list},
                           {"ResourceType": "volume", "Tags": tag_list}],
    )
    for wait in (2, 4, 8, 16, 30, 0):
        try:
            return ec2.run_instances(**kwargs)["Instances"][0]
        except ClientError as e:
            if not (error_code(e) == "InvalidParameterValue" and PROFILE_NOT_READY in str(e)) or not wait:
                raise
            sleep(wait)  # the instance profile is not visible to EC2 yet
    raise AssertionError("unreachable")


def decode_user_data(b64: str) -> str:
    return base64.b64decode(b64).decode()


def wait_online(ssm, instance_id: str, timeout_s: float, *, sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic, echo: Callable[[str], None] = print) -> None:
    """Until SSM's agent on the host reports ``PingStatus`` Online; HobsonError after ``timeout_s``."""
    deadline = clock() + timeout_s
    wait, last = 2.0, None
    while True:
        info = ssm.describe_instance_information(
            Filters=[{"Key": "InstanceIds", "Values": [instance_id]}]).get("InstanceInformationList", [])
        status = info[0].get("PingStatus") if info else "not registered"
        if status == "Online":
            return
        if status != last:
            echo(f"[aws] {instance_id}: SSM agent {status}; waiting")
            last = status
        if clock() + wait > deadline:
            raise HobsonError(f"{instance_id} did not report Online to SSM within {timeout_s:.0f}s (last: {status}). "
                              "Check that the AMI runs the SSM agent and the subnet reaches SSM (public IP or "
                              "VPC endpoints); aws/teardown terminates the host")
        sleep(wait)
        wait = min(wait * 2, 15.0)


def terminate(clients: Clients, cfg: AwsConfig, region: str, instance_ids: list[str]) -> list[str]:
    """Terminate those of ``instance_ids`` that carry the tool's tag; return the ones terminated."""
    ec2 = clients("ec2", region)
    ours = {i["InstanceId"] for i in tagged_instances(ec2, cfg, ["pending", "running", "stopping", "stopped"])}
    ids = [i for i in instance_ids if i in ours]
    if ids:
        ec2.terminate_instances(InstanceIds=ids)
    return ids


def teardown(clients: Clients, cfg: AwsConfig, regions: list[str] | None = None,
             run_id: str | None = None) -> dict[str, list[str]]:
    """Terminate every live instance this tool tagged (optionally only one run's), per region."""
    out: dict[str, list[str]] = {}
    for region in regions or cfg.regions:
        ec2 = clients("ec2", region)
        ids = [i["InstanceId"] for i in tagged_instances(ec2, cfg, ["pending", "running", "stopping", "stopped"],
                                                         run_id)]
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
        out[region] = ids
    return out
