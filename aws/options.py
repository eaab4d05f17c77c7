"""``configs/aws.yaml`` as dataclasses, validated by :func:`hobson.config.load_config`.

Unknown keys are errors naming ``file:line``; combinations are checked in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hobson.config import config_from_dict
from hobson.errors import ConfigError
from hobson.records import REPO_ROOT

DEFAULT_AWS_CONFIG = REPO_ROOT / "configs" / "aws.yaml"

# Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04): NVIDIA driver, CUDA, aws CLI, python3.
DLAMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


@dataclass
class InstanceChoice:
    RANGES: ClassVar[dict[str, str]] = {
        "gpus": ">= 0",
    }

    type: str
    gpus: int  # GPUs the type has; a type with fewer than --ngpu is never tried

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ConfigError(f"instance_types: gpus must be >= 0, got {self.gpus} for {self.type}")


@dataclass
class AmiOptions:
    id: str | None = None  # an explicit AMI id, used in every region (wins over ssm_parameter)
    ssm_parameter: str | None = DLAMI_PARAMETER  # public SSM parameter holding the region's AMI id

    def __post_init__(self) -> None:
        if not self.id and not self.ssm_parameter:
            raise ConfigError("ami: set either id or ssm_parameter")


@dataclass
class PollOptions:
    RANGES: ClassVar[dict[str, str]] = {
        "initial_s": "> 0", "max_s": "> 0", "factor": ">= 1", "not_found_s": ">= 0",
    }

    initial_s: float = 1.0  # first wait between get_command_invocation calls
    max_s: float = 30.0  # the backoff doubles up to this
    factor: float = 2.0
    not_found_s: float = 120.0  # how long InvocationDoesNotExist is retried (the agent may be slow to pick up)

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.max_s < self.initial_s or self.factor < 1:
            raise ConfigError("poll: need 0 < initial_s <= max_s and factor >= 1")


@dataclass
class HostOptions:
    RANGES: ClassVar[dict[str, str]] = {
        "root_volume_gb": ">= 8",
    }

    home: str = "/opt/dlami/nvme/hobson"  # the project's home on the host: code/, runs/, logs/, venv/
    python: str = "python3"  # interpreter that builds the venv (or runs everything when venv is false)
    venv: bool = True  # a venv at <home>/venv with the project's pinned dependencies
    extras: str = "aws,train"  # setup.py extras installed into the venv
    scratch_mount: str | None = "/opt/dlami/nvme"  # mount unmounted instance-store NVMe here; null: leave disks
    prefetch_models: list[str] = field(default_factory=list)  # HF model ids fetched into the cache when online
    root_volume_gb: int = 200


@dataclass
class AwsConfig:
    RANGES: ClassVar[dict[str, str]] = {
        "safety_shutdown_minutes": ">= 10",  # the host needs time to start
        "execution_timeout_s": "[1, 172800]",  # AWS-RunShellScript's range
        "delivery_timeout_s": "[30, 2592000]",  # send_command's range
        "online_timeout_s": ">= 1", "mirror_interval_s": ">= 1", "follow_interval_s": "> 0",
        "min_remaining_minutes": ">= 0",
    }

    regions: list[str] = field(default_factory=lambda: ["us-east-1", "us-west-2"])
    # Tried in this order (each type in every region before the next type) until one launches.
    instance_types: list[InstanceChoice] = field(default_factory=lambda: [InstanceChoice("p5.48xlarge", 8)])
    ami: AmiOptions = field(default_factory=AmiOptions)
    bucket: str | None = None  # null: hobson-<account id>-<bucket_region>
    bucket_region: str = "us-east-1"
    role_name: str = "hobson-ssm-host"
    security_group: str = "hobson-no-ingress"
    tag_key: str = "hobson:managed"
    tag_value: str = "true"
    safety_shutdown_minutes: int = 720  # the host powers itself off (and terminates) after this
    execution_timeout_s: int = 3600  # AWS-RunShellScript executionTimeout (set-up and start, not the run)
    delivery_timeout_s: int = 600  # send_command TimeoutSeconds: how long SSM tries to deliver
    online_timeout_s: int = 900  # how long to wait for the SSM agent to report Online
    mirror_interval_s: int = 60  # host: copy run.json, stages.jsonl and logs to S3 this often
    follow_interval_s: float = 30.0  # runner: read the mirrored record this often while following
    reuse_host: bool = True  # reuse a running host this tool tagged, if its safety timer has time left
    min_remaining_minutes: int = 120  # ... at least this much
    terminate_after_run: bool = True  # terminate the host once the run ended and its outputs are in S3
    output_prefix: str = "ssm-output"  # S3 prefix of the SSM command outputs (stdout/stderr)
    poll: PollOptions = field(default_factory=PollOptions)
    host: HostOptions = field(default_factory=HostOptions)

    def __post_init__(self) -> None:
        self.instance_types = [c if isinstance(c, InstanceChoice) else config_from_dict(c, InstanceChoice,
                                                                                        "instance_types")
                               for c in self.instance_types]
        if not self.regions:
            raise ConfigError("regions: list at least one region")
        if not self.instance_types:
            raise ConfigError("instance_types: list at least one {type, gpus}")
