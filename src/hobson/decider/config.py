"""The decider training config: one flat dataclass read from YAML (``configs/train.yaml``).

Unknown keys and wrongly typed values are errors naming the file, line and key
(:func:`hobson.config.load_config`); ``key=value`` overrides from the command line go through
the same checks. ``__post_init__`` rejects impossible combinations and says what to set instead.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import yaml

from hobson.config import config_from_dict, load_config
from hobson.errors import ConfigError

HEAD_TYPES = ("pointer", "slot")
KL_DIRECTIONS = ("forward", "reverse")
ON_USR2 = ("exit", "continue")
DEVICES = ("auto", "cpu", "cuda")

# Keys that steer a run but not what it computes: a resumed run may change them. Every other key
# must equal the checkpoint's, or the resumed run would not continue the same training.
RUN_CONTROL_KEYS = frozenset({
    "output_dir", "checkpoint_every", "keep_checkpoints", "on_usr2", "stop_after_steps",
    "eval_every", "val_batch_size", "log_every", "num_threads", "resume", "trace_dir", "device",
    "val_file",
})


@dataclass
class TrainConfig:
    """Every knob of the decider training recipe. Paths are relative to the working directory."""

    # --- data -----------------------------------------------------------------------------
    base_model: str  # a local HF causal-LM directory (the torso); its LM head is dropped
    train_files: list[str]  # corpus JSONL files, concatenated in this order (teacher index space)
    output_dir: str  # checkpoints/ and final/ are written here
    teacher_files: list[str] = field(default_factory=list)  # {"i", "probs"} lines; i indexes train rows
    val_file: str | None = None  # validated on rank 0 in canonical order with the base instruction
    tokenizer: str | None = None  # defaults to base_model

    # --- model ----------------------------------------------------------------------------
    head_type: str = "pointer"  # pointer: any option count; slot: at most num_slots options
    pointer_dim: int = 64
    head_hidden: int = 0  # 0: linear query/key projections; >0: one GELU hidden layer of this width
    num_slots: int = 8
    use_lora: bool = True  # false trains the head alone on a frozen torso
    lora_r: int = 8
    lora_alpha: int = 16  # usually 2 * lora_r
    # Dropout draws from each rank's RNG, so a run with dropout > 0 is not bit-equal across world
    # sizes; 0 keeps DDP exactly equal to one process.
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    force_bos: bool = False  # prepend the tokenizer's BOS (Gemma and Llama expect one)
    max_length: int = 1024  # longer rows lose state tokens from the left, never options
    gradient_checkpointing: bool = False
    bf16: bool = False  # GPU only; CPU runs in fp32
    attn_implementation: str = "sdpa"

    # --- loss -----------------------------------------------------------------------------
    score_smoothing: float = 0.1  # ordinal smoothing epsilon for score rows
    kl_teacher_weight: float = 1.0
    kl_frozen_weight: float = 0.0  # KL to the frozen torso's option-letter readout
    kl_direction: str = "forward"  # forward: KL(target||model); reverse: KL(model||target)

    # --- optimisation -----------------------------------------------------------------------
    seed: int = 0
    epochs: int = 1
    micro_batch_size: int = 8  # rows per forward; no forward is ever larger, at any world size
    grad_accum: int = 4  # micro-batches per optimizer step (global, whatever the world size)
    lr: float = 2e-4
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # linear decay ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # 0 disables clipping
    length_group_chunk: int = 64  # micro-batches per length-sorted chunk of the shuffled epoch

    # --- run control (may change on resume) -------------------------------------------------
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: only USR2/stop/final
    keep_checkpoints: int = 2  # newest step checkpoints kept; 0 keeps all
    on_usr2: str = "exit"  # exit: checkpoint then exit 75; continue: checkpoint and keep training
    stop_after_steps: int | None = None  # checkpoint and exit 0 after this global step
    eval_every: int = 0  # 0: validate only at the end (when val_file is set)
    val_batch_size: int = 16
    log_every: int = 1
    num_threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    resume: bool = True  # continue from the newest checkpoint in output_dir/checkpoints
    device: str = "auto"  # auto: cuda when available
    trace_dir: str | None = None  # debug: per-step all-reduced gradients and rendered token ids

    def __post_init__(self) -> None:
        problems = []
        if self.head_type not in HEAD_TYPES:
            problems.append(f"head_type {self.head_type!r} is not one of {', '.join(HEAD_TYPES)}")
        if self.kl_direction not in KL_DIRECTIONS:
            problems.append(f"kl_direction {self.kl_direction!r} is not one of {', '.join(KL_DIRECTIONS)}")
        if self.on_usr2 not in ON_USR2:
            problems.append(f"on_usr2 {self.on_usr2!r} is not one of {', '.join(ON_USR2)}")
        if self.device not in DEVICES:
            problems.append(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        for key in ("epochs", "micro_batch_size", "grad_accum", "max_length", "pointer_dim", "num_slots",
                    "lora_r", "length_group_chunk", "val_batch_size", "log_every"):
            if getattr(self, key) < 1:
                problems.append(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("warmup_steps", "checkpoint_every", "keep_checkpoints", "eval_every", "num_threads",
                    "head_hidden", "weight_decay", "grad_clip", "kl_teacher_weight", "kl_frozen_weight"):
            if getattr(self, key) < 0:
                problems.append(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.score_smoothing < 1:
            problems.append(f"score_smoothing must be in [0, 1), got {self.score_smoothing}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.adam_betas) != 2:
            problems.append(f"adam_betas must be two numbers, got {self.adam_betas}")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            problems.append(f"stop_after_steps must be >= 1 or null, got {self.stop_after_steps}")
        if not self.train_files:
            problems.append("train_files is empty; list at least one corpus JSONL file")
        if self.bf16 and self.device == "cpu":
            problems.append("bf16 is for GPUs; set bf16: false for a CPU run (CPU trains in fp32)")
        if problems:
            raise ConfigError("; ".join(problems))


def load_train_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read ``path`` into a :class:`TrainConfig`, then apply ``key=value`` overrides (YAML values).

    An unknown key in the file or in an override is an error naming it (and the file and line).
    """
    cfg = load_config(path, TrainConfig)
    if not overrides:
        return cfg
    data = dataclasses.asdict(cfg)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    bad = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            bad.append(f"override {item!r} is not key=value")
        elif key not in names:
            bad.append(f"override {item!r}: unknown key '{key}'; allowed: {', '.join(sorted(names))}")
        else:
            data[key] = yaml.safe_load(value)
    if bad:
        raise ConfigError("invalid overrides for " + str(path) + ":\n  " + "\n  ".join(bad))
    return config_from_dict(data, TrainConfig, origin=f"{path} (with overrides)")


def config_to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def resume_conflicts(saved: dict, cfg: TrainConfig) -> list[str]:
    """Keys (outside RUN_CONTROL_KEYS) whose value differs from the checkpoint's config."""
    now = config_to_dict(cfg)
    keys = sorted((set(saved) | set(now)) - RUN_CONTROL_KEYS)
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
