"""boto3 clients per (service, region), or in dry-run a recorder that prints each call.

Credentials and region come from the standard AWS chain; boto3 also honours ``AWS_ENDPOINT_URL``
(the tests point it at a moto server). The dry-run recorder answers with placeholders shaped
like the real responses, and "not found" for every existence check, so it prints what a first
run in an empty account would call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError


def _missing(code: str, status: int = 404) -> Callable[..., Any]:
    def raise_(**kwargs: Any) -> Any:
        raise ClientError({"Error": {"Code": code, "Message": "(dry run: assumed missing)"},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "dry-run")
    return raise_


# What the recorder answers; anything not listed answers {}.
_DRY_ANSWERS: dict[str, Any] = {
    "sts.get_caller_identity": {"Account": "<account-id>"},
    "s3.head_bucket": _missing("404"),
    "s3.get_bucket_encryption": _missing("ServerSideEncryptionConfigurationNotFoundError"),
    "s3.get_public_access_block": _missing("NoSuchPublicAccessBlockConfiguration"),
    "iam.get_role": _missing("NoSuchEntity"),
    "iam.get_role_policy": _missing("NoSuchEntity"),
    "iam.get_instance_profile": _missing("NoSuchEntity"),
    "iam.list_attached_role_policies": {"AttachedPolicies": []},
    "ec2.describe_vpcs": {"Vpcs": [{"VpcId": "<default-vpc>"}]},
    "ec2.describe_security_groups": {"SecurityGroups": []},
    "ec2.create_security_group": {"GroupId": "<sg-id>"},
    "ec2.describe_instances": {"Reservations": []},
    "ec2.describe_instance_type_offerings": lambda **kw: {"InstanceTypeOfferings": [
        {"InstanceType": kw["Filters"][0]["Values"][0], "Location": "<az>"}]},
    "ec2.describe_subnets": {"Subnets": [{"SubnetId": "<subnet-id>", "AvailabilityZone": "<az>"}]},
    "ec2.run_instances": lambda **kw: {"Instances": [{"InstanceId": "<instance-id>", "InstanceType": kw["InstanceType"],
                                                      "Placement": {"AvailabilityZone": "<az>"}}]},
    "ssm.get_parameter": lambda **kw: {"Parameter": {"Value": f"<ami from {kw['Name']}>"}},
    "ssm.describe_instance_information": {"InstanceInformationList": [{"InstanceId": "<instance-id>",
                                                                       "PingStatus": "Online"}]},
    "ssm.send_command": {"Command": {"CommandId": "<command-id>"}},
    "ssm.get_command_invocation": {"Status": "Success", "StatusDetails": "Success", "ResponseCode": 0},
}


class _Recorder:
    def __init__(self, service: str, region: str, out: Callable[[str], None]) -> None:
        self._service, self._region, self._out = service, region, out

    def __getattr__(self, op: str) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            shown = {k: (f"<{len(v)} bytes>" if isinstance(v, bytes) else v) for k, v in kwargs.items()
                     if k != "Body"}
            if "Body" in kwargs:
                shown["Body"] = "<file>"
            if op == "send_command":  # the commands are printed in full, one per line, after the calls
                n = len(kwargs["Parameters"]["commands"])
                shown["Parameters"] = {**kwargs["Parameters"], "commands": f"<{n} lines: the host command below>"}
            self._out(f"aws {self._service}.{op} [{self._region}] {json.dumps(shown, sort_keys=True, default=str)}")
            answer = _DRY_ANSWERS.get(f"{self._service}.{op}", {})
            return answer(**kwargs) if callable(answer) else answer
        return call


class Clients:
    """One client per (service, region); ``dry_run`` swaps them for printing recorders."""

    def __init__(self, *, dry_run: bool = False, out: Callable[[str], None] = print, session: Any = None) -> None:
        self.dry_run = dry_run
        self._out = out
        self._session = session
        self._cache: dict[tuple[str, str], Any] = {}

    def __call__(self, service: str, region: str) -> Any:
        key = (service, region)
        if key not in self._cache:
            if self.dry_run:
                self._cache[key] = _Recorder(service, region, self._out)
            else:
                import boto3

                if self._session is None:  # boto3's default session: service models load once per process
                    if boto3.DEFAULT_SESSION is None:
                        boto3.setup_default_session()
                    self._session = boto3.DEFAULT_SESSION
                self._cache[key] = self._session.client(service, region_name=region)
        return self._cache[key]


def error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
