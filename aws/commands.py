"""Shell commands on the host through ``AWS-RunShellScript``, and polling them to a final state.

Every command has an explicit ``executionTimeout`` and writes its stdout/stderr to S3
(``OutputS3BucketName``/``OutputS3KeyPrefix``): the inline output of ``get_command_invocation``
stops at 24,000 characters, so it is never read; reports name the S3 location instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from botocore.exceptions import ClientError

from hobson.aws.clients import error_code
from hobson.aws.options import AwsConfig, PollOptions
from hobson.errors import HobsonError

FINAL = ("Success", "Failed", "TimedOut", "Cancelled")
PLUGIN_DIR = "awsrunShellScript/0.awsrunshellscript"  # where the agent puts the one step's stdout/stderr


@dataclass
class CommandResult:
    command_id: str
    instance_id: str
    status: str  # one of FINAL
    status_details: str
    response_code: int | None
    output_s3: str  # s3://bucket/prefix/<command id>/<instance id>/awsrunShellScript/0.awsrunshellscript/

    @property
    def ok(self) -> bool:
        return self.status == "Success"

    def describe(self) -> str:
        return (f"command {self.command_id} on {self.instance_id}: {self.status} ({self.status_details}, "
                f"exit {self.response_code}); output: {self.output_s3}stdout and {self.output_s3}stderr")


def output_location(bucket: str, prefix: str, command_id: str, instance_id: str) -> str:
    return f"s3://{bucket}/{prefix.rstrip('/')}/{command_id}/{instance_id}/{PLUGIN_DIR}/"


def send_shell(ssm, instance_id: str, commands: list[str], cfg: AwsConfig, bucket: str, bucket_region: str,
               comment: str) -> str:
    resp = ssm.send_command(
        InstanceIds=[instance_id], DocumentName="AWS-RunShellScript", Comment=comment[:100],
        TimeoutSeconds=cfg.delivery_timeout_s,
        Parameters={"commands": commands, "executionTimeout": [str(cfg.execution_timeout_s)]},
        OutputS3BucketName=bucket, OutputS3KeyPrefix=cfg.output_prefix, OutputS3Region=bucket_region,
    )
    return resp["Command"]["CommandId"]


def wait_command(ssm, command_id: str, instance_id: str, poll: PollOptions, *, bucket: str, prefix: str,
                 deadline_s: float | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> CommandResult:
    """Poll ``get_command_invocation`` with backoff until a final state.

    ``InvocationDoesNotExist`` right after ``send_command`` is normal (the invocation is created
    asynchronously) and retried for ``poll.not_found_s`` seconds.
    """
    t0 = clock()
    wait = poll.initial_s
    while True:
        try:
            inv = ssm.get_command_invocation(CommandId=command_id, InstanceId=instance_id)
        except ClientError as e:
            if error_code(e) != "InvocationDoesNotExist":
                raise
            if clock() - t0 > poll.not_found_s:
                raise HobsonError(f"command {command_id} on {instance_id}: SSM reports no invocation after "
                                  f"{poll.not_found_s:.0f}s (InvocationDoesNotExist); is the instance managed by "
                                  "SSM (describe-instance-information)?") from None
            inv = None
        if inv is not None and inv["Status"] in FINAL:
            code = inv.get("ResponseCode")
            return CommandResult(command_id, instance_id, inv["Status"], inv.get("StatusDetails", ""),
                                 None if code is None or code == -1 else int(code),
                                 output_location(bucket, prefix, command_id, instance_id))
        if deadline_s is not None and clock() - t0 > deadline_s:
            raise HobsonError(f"command {command_id} on {instance_id} still {inv and inv['Status']} after "
                              f"{deadline_s:.0f}s; output: {output_location(bucket, prefix, command_id, instance_id)}")
        sleep(wait)
        wait = min(wait * poll.factor, poll.max_s)


def read_output(s3, result: CommandResult, stream: str = "stderr", max_bytes: int = 8000) -> str:
    """The end of a command's stdout or stderr from S3 ('' when the agent wrote none)."""
    bucket, _, key = result.output_s3.removeprefix("s3://").partition("/")
    try:
        obj = s3.get_object(Bucket=bucket, Key=key + stream, Range=f"bytes=-{max_bytes}")
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404", "InvalidRange"):
            return ""
        raise
    return obj["Body"].read().decode(errors="replace")
