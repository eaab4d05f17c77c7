"""The settings of one RL run, typed at the edge; ``--resume`` refuses any that changed.

Every field below is recorded in ``<output>/run.json`` (``rl.settings``). A resumed run must
repeat them all except :data:`RESUME_MAY_CHANGE` (``stop_after``, ``resume``): total updates,
data, precision, batch settings, ``train_env_vars``, revisions, seeds and objective parameters
all change the run's bits, so a changed one is refused by name (:func:`check_resume`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hobson.errors import ConfigError
from hobson.rl.objectives import AGGREGATIONS, GAE_MASKED

ALGORITHMS = ("ppo", "grpo", "dppo", "flow-dppo")
PRECISIONS = {"fp32": "float32", "fp16": "float16"}
# where the engine runs does not change the bits (a remote engine is bit-identical to the
# in-process one), so a run may resume against another server, or in-process
RESUME_MAY_CHANGE = frozenset(
    {"stop_after", "resume", "engine_address_file", "engine_timeout", "publish_timeout", "engine_ready_timeout",
     "keep_checkpoints", "keep_publications", "checkpoint_in_line", "transport", "weight_bucket_mb",
     "rollout_servers", "checkpoint_every"}
)
# how each version reaches the engine (hobson.rollout.transport); the bits are the same either way
TRANSPORT_NAMES = ("shared-dir", "dist")
TINY_PREFIX = "tiny:"
LONG_PROMPTS = ("drop", "truncate")
# v2: VIME's conventions (docs/RL.md); v1 (no record) was hobson's own before them
CONVENTIONS_VERSION = 2


@dataclass
class RLConfig:
    RANGES: ClassVar[dict[str, str]] = {
        "updates": ">= 1", "stop_after": ">= 1", "seed": ">= 0", "prompts_per_update": ">= 1",
        "completions_per_prompt": ">= 1", "max_prompt_tokens": ">= 1", "max_new_tokens": ">= 1",
        "temperature": "> 0",
        "lr": "> 0", "critic_lr": "> 0", "clip_eps": "> 0", "value_clip": "> 0", "gamma": "[0, 1]", "lam": "[0, 1]",
        "kl_budget": "> 0", "grad_clip": ">= 0", "backprop_steps": ">= 1", "loss_scale": "> 0",
        "engine_timeout": "> 0", "publish_timeout": "> 0", "engine_ready_timeout": "> 0", "keep_checkpoints": ">= 0",
        "keep_publications": ">= 0", "weight_bucket_mb": "> 0",
        "rollout_servers": ">= 1", "rollout_unit": ">= 0", "checkpoint_every": ">= 1",
    }

    algorithm: str = "grpo"
    # model directory (config.json + safetensors), or "tiny:huginn_raven" / "tiny:nanbeige"
    # for an embedded random model; None means tiny:huginn_raven
    model: str | None = None
    data: str | None = None  # JSONL with string prompt/label; None: the shipped arithmetic data
    output: str = "runs/rl"
    updates: int = 3  # total updates of the run (a resumed run repeats the same total)
    stop_after: int | None = None  # stop (checkpointed) after this update; resume later
    resume: bool = False
    engine: str = "native"  # native | vllm (vllm serves plain HF models and Nanbeige)
    trainer: str = "deepspeed"  # deepspeed | torch (plain torch: CPU tests only)
    # training precision fp32 | fp16; None: VIME's default, fp16 (loss scale 128) for Huginn on a
    # CUDA device, else fp32 (resolved by resolve_defaults and recorded so)
    precision: str | None = None
    rollout_precision: str | None = None  # must equal precision; None: the same
    model_revision: str | None = None  # recorded in manifests and traces; checked against the model dir
    engine_revision: str | None = None
    train_env_vars: list[str] = field(default_factory=list)  # K=V set in the training process
    recompute: bool = False  # activation checkpointing in training forwards
    # on a CUDA device, training forwards run the norm, RoPE and MLP chains as compiled kernels
    # (any length; 1.28x on Huginn's forward+backward bench); changes rounding, so part of a run's bits
    compiled_chains: bool = False
    seed: int = 42
    prompts_per_update: int = 4
    # None: VIME's looped recipe, 4 for GRPO (at least 2), 1 for PPO, DPPO and Flow-DPPO
    completions_per_prompt: int | None = None
    max_prompt_tokens: int = 128
    long_prompts: str = "drop"  # drop (VIME: rows longer than max_prompt_tokens are left out) | truncate
    max_new_tokens: int = 48
    temperature: float = 0.8
    reward: str = "math"  # math | test-token-value | test-constant (the test ones: tests only)
    optimizer: str = "SGD"  # any torch.optim class name; SGD has no momentum unless optimizer_args say so
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    lr: float = 1e-5
    critic_lr: float | None = None  # None: lr
    clip_eps: float = 0.2
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    kl_budget: float = 0.01  # Flow-DPPO's per-token KL gate
    # conventions (docs/RL.md): VIME's by default
    loss_aggregation: str = "sample-mean"  # sample-mean (each sequence's token mean, then their mean) | token-mean
    gae_masked: str = "span"  # span (GAE over the whole response span) | skip (carry over masked positions)
    grad_clip: float = 1.0  # global gradient-norm clip (Megatron's default, which VIME's recipe keeps); 0: none
    backprop_steps: int | None = None  # Huginn: recurrence steps with gradient (None: mean_backprop_depth)
    loss_scale: float = 128.0  # static loss scale in fp16
    device: str = "cpu"  # training device
    engine_device: str | None = None  # rollout device (None: device)
    # a rollout server's address file (python -m jobs.rollout_server); None: the engine runs in-process
    engine_address_file: str | None = None
    engine_timeout: float = 600.0  # seconds for a remote engine to answer one generate request
    publish_timeout: float = 600.0  # seconds for a remote engine to load and commit one publication
    engine_ready_timeout: float = 600.0  # seconds to wait for the remote engine's address file + ping
    # shared-dir: write each version to disk, the engine loads it; dist: send it from memory (a
    # process group with a remote engine, a direct hand-off in-process), no file on the critical path
    transport: str = "shared-dir"
    weight_bucket_mb: float = 256.0  # dist: tensors travel in buckets of at most this many MiB
    # requests per rollout unit: consecutive slices of an update's requests, each one generate call
    # on one server (0: the whole update is one unit). Part of the run's bits: a batch's padding and
    # GEMM shapes are its unit's, so results do not depend on how many servers there are
    rollout_unit: int = 0
    rollout_servers: int = 1  # rollout servers (engine_address_file then holds {index}); any N, same bits
    # disk: official-size checkpoints are tens of GB (fp16 keeps fp32 master weights); 0 keeps all
    # checkpoint after every K-th update (and always after the last update of a session): which
    # checkpoints exist depends on this alone; a resume replays from the newest, bit for bit
    checkpoint_every: int = 1
    keep_checkpoints: int = 0  # the newest N checkpoints stay, older ones are removed once a newer is whole
    keep_publications: int = 0  # weights kept: the newest N versions and checkpointed ones (0: all); manifests stay
    # write each checkpoint before the next update starts, instead of in a background thread from a
    # copy taken on the training device (that copy needs as much free memory as the checkpoint holds)
    checkpoint_in_line: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.algorithm not in ALGORITHMS:
            problems.append(f"algorithm {self.algorithm!r}: supported {', '.join(ALGORITHMS)}")
        for name in ("precision", "rollout_precision"):
            v = getattr(self, name)
            if v is not None and v not in PRECISIONS:
                problems.append(f"{name} {v!r}: supported {', '.join(PRECISIONS)}")
        if self.rollout_precision is not None and self.rollout_precision != (self.precision or "fp32"):
            problems.append(
                f"rollout_precision {self.rollout_precision} != precision {self.precision}: rollout and training "
                "must use the same precision, else behaviour and trainer log-probs disagree"
            )
        for name, allowed in (("long_prompts", LONG_PROMPTS), ("loss_aggregation", AGGREGATIONS),
                              ("gae_masked", GAE_MASKED)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} {getattr(self, name)!r}: supported {', '.join(allowed)}")
        if self.grad_clip < 0:
            problems.append(f"grad_clip {self.grad_clip} must be >= 0 (0: no clipping)")
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            problems.append("max_prompt_tokens and max_new_tokens must be >= 1")
        if self.engine not in ("native", "vllm"):
            problems.append(f"engine {self.engine!r}: supported native, vllm")
        if self.trainer not in ("deepspeed", "torch"):
            problems.append(f"trainer {self.trainer!r}: supported deepspeed, torch")
        if self.trainer == "torch" and self.precision not in (None, "fp32"):
            problems.append("trainer torch supports fp32 only (fp16 needs DeepSpeed's loss scaling)")
        if self.precision == "fp16" and self.device == "cpu":
            problems.append("precision fp16 needs a CUDA device (DeepSpeed's CPU accelerator has no fp16); use fp32")
        if self.updates < 1:
            problems.append(f"updates {self.updates} must be >= 1")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.updates:
            problems.append(f"stop_after {self.stop_after} must be in 1..updates ({self.updates})")
        if self.prompts_per_update < 1:
            problems.append(f"prompts_per_update {self.prompts_per_update} must be >= 1")
        n = self.completions_per_prompt
        if n is not None and (n < 1 or (self.algorithm == "grpo" and n < 2)):
            problems.append(f"completions_per_prompt {n}: GRPO needs >= 2, others >= 1")
        seqs = self.prompts_per_update * (n or 1)
        if self.algorithm == "flow-dppo" and (seqs < 2 or seqs % 2):
            problems.append(
                f"flow-dppo takes two optimizer steps on half the completions each: prompts_per_update x "
                f"completions_per_prompt = {seqs} must be even and >= 2"
            )
        for name in ("keep_checkpoints", "keep_publications"):
            if getattr(self, name) < 0:
                problems.append(f"{name} {getattr(self, name)} must be >= 0 (0: keep all)")
        for name in ("engine_timeout", "publish_timeout", "engine_ready_timeout"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} {getattr(self, name)} must be > 0 seconds")
        if self.transport not in TRANSPORT_NAMES:
            problems.append(f"transport {self.transport!r}: supported {', '.join(TRANSPORT_NAMES)}")
        if self.transport == "dist" and self.engine != "native":
            problems.append("transport dist: the vLLM engine loads publication files; use --transport shared-dir")
        if self.rollout_servers < 1:
            problems.append(f"rollout_servers {self.rollout_servers} must be >= 1")
        if self.rollout_servers > 1 and (self.engine_address_file is None or "{index}" not in self.engine_address_file):
            problems.append(f"rollout_servers {self.rollout_servers}: engine_address_file must name each server's "
                            "address file with {index} (e.g. runs/x/engine/address-77-{index}.json)")
        if self.rollout_unit < 0:
            problems.append(f"rollout_unit {self.rollout_unit} must be >= 0 (0: the whole update is one unit)")
        if not self.weight_bucket_mb > 0:
            problems.append(f"weight_bucket_mb {self.weight_bucket_mb} must be > 0")
        if self.engine_address_file is not None and self.engine != "native":
            problems.append("engine_address_file: the rollout server runs the native engine; use --engine native")
        if self.temperature < 0:
            problems.append(f"temperature {self.temperature} must be >= 0 (0: greedy)")
        for kv in self.train_env_vars:
            if "=" not in kv or not kv.split("=", 1)[0]:
                problems.append(f"train_env_vars entry {kv!r} is not K=V")
        if problems:
            raise ConfigError("invalid RL settings:\n  " + "\n  ".join(problems))

    @property
    def model_spec(self) -> str:
        return self.model or f"{TINY_PREFIX}huginn_raven"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_family(spec: str) -> str:
    """``huginn_raven``, ``nanbeige``, ... of a model spec (``tiny:NAME`` or a directory's config.json)."""
    if spec.startswith(TINY_PREFIX):
        return spec[len(TINY_PREFIX):]
    path = Path(spec) / "config.json"
    try:
        return str(json.loads(path.read_text(encoding="utf-8")).get("model_type", "unknown"))
    except (OSError, ValueError) as e:
        msg = f"model {spec}: cannot read {path} ({e}); pass a model directory with its config.json"
        raise ConfigError(msg) from None


def resolve_defaults(cfg: RLConfig) -> RLConfig:
    """``cfg`` with every None default resolved to VIME's value for its algorithm, model and device."""
    cpp = cfg.completions_per_prompt
    if cpp is None:
        cpp = 4 if cfg.algorithm == "grpo" else 1
    precision = cfg.precision
    if precision is None:
        on_cuda = str(cfg.device).startswith("cuda")
        precision = "fp16" if on_cuda and model_family(cfg.model_spec) == "huginn_raven" else "fp32"
    return dataclasses.replace(cfg, completions_per_prompt=cpp, precision=precision)


def conventions(cfg: RLConfig) -> dict[str, Any]:
    """The conventions a run's numbers depend on, as run.json records them (docs/RL.md)."""
    return {
        "version": CONVENTIONS_VERSION,
        "loss_aggregation": cfg.loss_aggregation,
        "gae_masked": cfg.gae_masked,
        "long_prompts": cfg.long_prompts,
        "grad_clip": cfg.grad_clip,
        "completions_per_prompt": cfg.completions_per_prompt,
        "precision": cfg.precision,
        "value_loss": "max-squared (no 1/2), clipfrac |V - V_old| > value_clip",
        "flow_dppo_gate": "outward by log-ratio sign, KL clamped at 0",
        "kl_metric": "k1",
        "dppo_weight_metric": "raw weight mean",
        "request_seed": "seed + rollout_id * 1000003 + sample_index (mod 2**63)",
        "latent_seed": "blake2b(seed_le8 + position_le8, 8 bytes) le mod 2**63",
        "version_digest": "sha256 over names and 64 MiB pieces, each two 64-bit word sums on the tensor's device",
    }


def check_conventions(recorded: dict[str, Any] | None, cfg: RLConfig) -> None:
    """Refuse to resume a run recorded under other conventions, naming each that changed."""
    now = conventions(cfg)
    if recorded is None:
        raise ConfigError(
            f"--resume: this run was recorded before conventions were recorded (version 1, hobson's own: token-mean "
            f"losses, halved value loss, GAE skipping masked positions, SHA-256 seeds); this hobson uses version "
            f"{CONVENTIONS_VERSION} (VIME's, docs/RL.md). Start a new run, or resume it with the hobson that wrote it"
        )
    # the settings among them (loss_aggregation, precision, ...) are named by check_resume
    diffs = [f"{k}: run has {recorded.get(k)!r}, now {v!r}" for k, v in now.items()
             if recorded.get(k) != v and k not in cfg.to_dict()]
    if diffs:
        raise ConfigError(
            "--resume refuses a run recorded under other conventions (docs/RL.md):\n  " + "\n  ".join(diffs)
        )


def check_resume(recorded: dict[str, Any], current: RLConfig) -> None:
    """Refuse to resume with settings that differ from the interrupted run's, naming each."""
    now = current.to_dict()
    # a setting added after the run was recorded had its default's behaviour then (rollout_unit 0)
    defaults = {f.name: f.default for f in dataclasses.fields(RLConfig) if f.default is not dataclasses.MISSING}
    recorded = {**{k: v for k, v in defaults.items() if k not in recorded}, **recorded}
    diffs = [
        f"{k}: run has {recorded.get(k)!r}, this call {now.get(k)!r}"
        for k in sorted(set(recorded) | set(now))
        if k not in RESUME_MAY_CHANGE and recorded.get(k) != now.get(k)
    ]
    if diffs:
        raise ConfigError(
            "--resume refuses settings that differ from the interrupted run (they change its results):\n  "
            + "\n  ".join(diffs)
        )
