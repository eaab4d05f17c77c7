"""Typed configs the launcher reads: the recipe config and the cluster profile.

Both are plain YAML files validated on load by :func:`hobson.config.load_config`: unknown keys
are errors naming ``file:line``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from hobson.errors import ConfigError
from hobson.records import REPO_ROOT

REPO = REPO_ROOT
DEFAULT_RECIPE = REPO / "configs" / "recipe.yaml"
DEFAULT_CLUSTER = REPO / "configs" / "cluster" / "default.yaml"


@dataclass
class CorpusOptions:
    RANGES: ClassVar[dict[str, str]] = {
        "scale": "> 0", "seed": ">= 0",
    }

    scale: float = 1.0  # multiplies every family's row count; 1.0 is the pinned embedded default
    seed: int = 0
    fetch_config: str = "configs/fetch.yaml"


@dataclass
class TeacherOptions:
    RANGES: ClassVar[dict[str, str]] = {
        "max_batch_tokens": ">= 1", "max_batch_rows": ">= 1", "shards": ">= 1",
    }

    model: str | None = None  # a local HF causal-LM directory; None builds the embedded tiny teacher
    max_batch_tokens: int = 4096
    max_batch_rows: int = 64
    shards: int | None = None  # None: one shard per GPU (--ngpu)


@dataclass
class DeciderOptions:
    RANGES: ClassVar[dict[str, str]] = {
        "replay_shards": ">= 1", "replay_max_batch_tokens": ">= 1", "replay_max_batch_rows": ">= 1",
        "min_kind_rows": ">= 1", "seeds": ">= 0",
    }

    parent_config: str = "configs/train-parent.yaml"
    train_config: str = "configs/train.yaml"
    torso: str | None = None  # base causal LM for parent and final model; None: the embedded tiny model
    init_from: str | None = None  # fine-tune the final model from this checkpoint (--ckpt)
    replay_shards: int | None = None  # None: one shard per GPU (--ngpu)
    replay_max_batch_tokens: int = 4096
    replay_max_batch_rows: int = 64
    min_kind_rows: int = 100  # calibration fits a per-kind temperature from this many rows up
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # `recipe release`: one final model per seed


@dataclass
class RecipeConfig:
    corpus: CorpusOptions = field(default_factory=CorpusOptions)
    teacher: TeacherOptions = field(default_factory=TeacherOptions)
    decider: DeciderOptions = field(default_factory=DeciderOptions)


# a DNS name or an IPv4 address (what a Slurm NodeAddr holds); Linux interface names are at most
# 15 characters (IFNAMSIZ) and hold no '/' or whitespace
HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*")
IFNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,14}")


@dataclass
class StageOverride:
    RANGES: ClassVar[dict[str, str]] = {
        "cpus": ">= 1", "mem_gb": ">= 1", "nodes": ">= 1",
    }

    time: str | None = None  # Slurm time limit, e.g. "02:00:00"
    cpus: int | None = None
    mem_gb: int | None = None
    # torchrun stages (parent, train): spread the --ngpu ranks over this many nodes, --ngpu/nodes
    # on each; every node's torchrun meets the others at one rendezvous (see ClusterProfile)
    nodes: int | None = None


@dataclass
class ClusterProfile:
    RANGES: ClassVar[dict[str, str]] = {
        "signal_seconds": ">= 1", "max_restarts": ">= 0",
    }

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    extra_sbatch: list[str] = field(default_factory=list)  # verbatim "#SBATCH" options, e.g. "--reservation=x"
    setup: list[str] = field(default_factory=list)  # shell lines before each job (module load, venv)
    python: str = "python"  # interpreter on the compute nodes
    signal_seconds: int = 120  # --signal=B:USR2@N: time to checkpoint before the limit (USR1 is NCCL's)
    max_restarts: int = 3  # requeues of a preempted or timed-out training job
    stages: dict[str, StageOverride] = field(default_factory=dict)
    # Multi-node torchrun: the host every node's torchrun meets at (c10d rendezvous; its port is
    # 20000 + job id % 20000). None: the job's first node, as `scontrol show hostnames` names it;
    # set it where that name resolves to an address the other nodes cannot reach.
    rdzv_address: str | None = None
    # The network interface(s) the ranks talk over, exported as GLOO_SOCKET_IFNAME and
    # NCCL_SOCKET_IFNAME to torchrun jobs (e.g. "ib0", or "eth0,eth1"); None leaves gloo and NCCL
    # to pick (gloo takes the interface the host name resolves to, NCCL the first non-loopback one).
    socket_ifname: str | None = None

    def __post_init__(self) -> None:
        from hobson.config import config_from_dict

        self.stages = {k: v if isinstance(v, StageOverride) else config_from_dict(v, StageOverride, f"stages.{k}")
                       for k, v in self.stages.items()}
        for line in self.extra_sbatch:
            if not line.startswith("--"):
                raise ConfigError(f"extra_sbatch entries are sbatch options like '--reservation=x', got {line!r}")
        # both land unquoted in a shell line and in torchrun's --rdzv_endpoint=HOST:PORT
        if self.rdzv_address is not None and not HOST_RE.fullmatch(self.rdzv_address):
            raise ConfigError(f"rdzv_address must be a host name or IPv4 address (letters, digits, '.', '-'), "
                              f"got {self.rdzv_address!r}")
        if self.socket_ifname is not None and not all(IFNAME_RE.fullmatch(n) for n in self.socket_ifname.split(",")):
            raise ConfigError(f"socket_ifname must be network interface names separated by commas (each 1-15 of "
                              f"letters, digits, '_', '.', '-', ':'; what `ip -brief link` lists), "
                              f"got {self.socket_ifname!r}")
