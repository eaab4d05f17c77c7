"""The settings of one RL run, typed at the edge; ``--resume`` refuses any that changed.

Every field below is recorded in ``<output>/run.json`` (``rl.settings``). A resumed run must
repeat them all except :data:`RESUME_MAY_CHANGE` (``stop_after``, ``resume``): total updates,
data, precision, batch settings, ``train_env_vars``, revisions, seeds and objective parameters
all change the run's bits, so a changed one is refused by name (:func:`check_resume`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hobson.errors import ConfigError

ALGORITHMS = ("ppo", "grpo", "dppo", "flow-dppo")
PRECISIONS = {"fp32": "float32", "fp16": "float16"}
# where the engine runs does not change the bits (a remote engine is bit-identical to the
# in-process one), so a run may resume against another server, or in-process
RESUME_MAY_CHANGE = frozenset(
    {"stop_after", "resume", "engine_address_file", "engine_timeout", "publish_timeout", "engine_ready_timeout",
     "keep_checkpoints", "keep_publications", "checkpoint_in_line"}
)
TINY_PREFIX = "tiny:"


@dataclass
class RLConfig:
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
    precision: str = "fp32"  # training precision: fp32 | fp16 (Huginn on GPU: fp16, loss scale 128)
    rollout_precision: str | None = None  # must equal precision; None: the same
    model_revision: str | None = None  # recorded in manifests and traces; checked against the model dir
    engine_revision: str | None = None
    train_env_vars: list[str] = field(default_factory=list)  # K=V set in the training process
    recompute: bool = False  # activation checkpointing in training forwards
    seed: int = 42
    prompts_per_update: int = 4
    completions_per_prompt: int = 4  # GRPO needs at least 2 per prompt
    max_prompt_tokens: int = 128
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
    backprop_steps: int | None = None  # Huginn: recurrence steps with gradient (None: mean_backprop_depth)
    loss_scale: float = 128.0  # static loss scale in fp16
    device: str = "cpu"  # training device
    engine_device: str | None = None  # rollout device (None: device)
    # a rollout server's address file (python -m jobs.rollout_server); None: the engine runs in-process
    engine_address_file: str | None = None
    engine_timeout: float = 600.0  # seconds for a remote engine to answer one generate request
    publish_timeout: float = 600.0  # seconds for a remote engine to load and commit one publication
    engine_ready_timeout: float = 600.0  # seconds to wait for the remote engine's address file + ping
    # disk: official-size checkpoints are tens of GB (fp16 keeps fp32 master weights); 0 keeps all
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
        if self.rollout_precision is not None and self.rollout_precision != self.precision:
            problems.append(
                f"rollout_precision {self.rollout_precision} != precision {self.precision}: rollout and training "
                "must use the same precision, else behaviour and trainer log-probs disagree"
            )
        if self.engine not in ("native", "vllm"):
            problems.append(f"engine {self.engine!r}: supported native, vllm")
        if self.trainer not in ("deepspeed", "torch"):
            problems.append(f"trainer {self.trainer!r}: supported deepspeed, torch")
        if self.trainer == "torch" and self.precision != "fp32":
            problems.append("trainer torch supports fp32 only (fp16 needs DeepSpeed's loss scaling)")
        if self.precision == "fp16" and self.device == "cpu":
            problems.append("precision fp16 needs a CUDA device (DeepSpeed's CPU accelerator has no fp16); use fp32")
        if self.updates < 1:
            problems.append(f"updates {self.updates} must be >= 1")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.updates:
            problems.append(f"stop_after {self.stop_after} must be in 1..updates ({self.updates})")
        if self.prompts_per_update < 1:
            problems.append(f"prompts_per_update {self.prompts_per_update} must be >= 1")
        if self.completions_per_prompt < 1 or (self.algorithm == "grpo" and self.completions_per_prompt < 2):
            problems.append(f"completions_per_prompt {self.completions_per_prompt}: GRPO needs >= 2, others >= 1")
        if self.algorithm == "flow-dppo" and self.prompts_per_update * self.completions_per_prompt < 2:
            problems.append("flow-dppo takes two optimizer steps on half the completions each: needs >= 2 completions")
        for name in ("keep_checkpoints", "keep_publications"):
            if getattr(self, name) < 0:
                problems.append(f"{name} {getattr(self, name)} must be >= 0 (0: keep all)")
        for name in ("engine_timeout", "publish_timeout", "engine_ready_timeout"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} {getattr(self, name)} must be > 0 seconds")
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


def check_resume(recorded: dict[str, Any], current: RLConfig) -> None:
    """Refuse to resume with settings that differ from the interrupted run's, naming each."""
    now = current.to_dict()
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
