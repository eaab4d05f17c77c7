"""The decider training config: one flat dataclass read from YAML (``configs/train.yaml``).

Unknown keys and wrongly typed values are errors naming the file, line and key
(:func:`hobson.config.load_config`); ``key=value`` overrides from the command line go through
the same checks. ``__post_init__`` rejects impossible combinations and says what to set instead.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import ClassVar

import yaml

from hobson.config import config_from_dict, load_config
from hobson.errors import ConfigError

HEAD_TYPES = ("pointer", "slot")
KL_DIRECTIONS = ("forward", "reverse")
LENGTH_KEYS = ("tokens", "chars")
ON_USR2 = ("exit", "continue")
DEVICES = ("auto", "cpu", "cuda")
GATED_DELTA_RULES = ("auto", "torch", "compiled")  # hobson.decider.kernels
LORA_KERNELS = ("auto", "peft", "fused")  # hobson.decider.fusion
CHAIN_KERNELS = ("auto", "eager", "liger", "compiled")  # hobson.decider.fusion
TORSO_INITS = ("pretrained", "random")

# Keys that steer a run but not what it computes: a resumed run may change them. Every other key
# must equal the checkpoint's, or the resumed run would not continue the same training.
RUN_CONTROL_KEYS = frozenset({
    "output_dir", "checkpoint_every", "keep_checkpoints", "on_usr2", "stop_after_steps",
    "eval_every", "val_batch_size", "log_every", "num_threads", "resume", "trace_dir", "device",
    "val_file", "gated_delta_rule", "compile_layers", "lora_kernel", "chain_kernel", "cuda_graphs",
    "graph_length_multiple",
    "fused_chains",  # retired (chain_kernel: compiled): checkpoints written with it still resume
})
# Keys added after checkpoints were first written: a checkpoint's config without one was trained
# with this value (what every run did before the key existed), so resuming it is no conflict.
ADDED_KEYS = {"torso_init": "pretrained"}


@dataclass
class TrainConfig:
    """Every knob of the decider training recipe. Paths are relative to the working directory."""
    RANGES: ClassVar[dict[str, str]] = {
        "pointer_dim": ">= 1", "head_hidden": ">= 0", "num_slots": ">= 1", "head_ensemble": ">= 1", "lora_r": ">= 1",
        "lora_alpha": "> 0", "lora_dropout": "[0, 1)", "max_length": ">= 1", "score_smoothing": "[0, 1)",
        "kl_teacher_weight": ">= 0", "kl_frozen_weight": ">= 0", "seed": ">= 0", "epochs": ">= 1",
        "micro_batch_size": ">= 1", "grad_accum": ">= 1", "lr": "> 0", "weight_decay": ">= 0",
        "adam_betas": "[0, 1)",
        "adam_eps": "> 0", "warmup_steps": ">= 0", "min_lr_ratio": "[0, 1]", "grad_clip": ">= 0",
        "length_group_chunk": ">= 1", "checkpoint_every": ">= 0", "keep_checkpoints": ">= 0",
        "stop_after_steps": ">= 1", "max_steps": ">= 1",
        "eval_every": ">= 0", "val_batch_size": ">= 1", "log_every": ">= 1", "num_threads": ">= 0",
        "graph_length_multiple": ">= 1",
    }

    # --- data -----------------------------------------------------------------------------
    base_model: str  # a local HF causal-LM directory (the torso); its LM head is dropped
    train_files: list[str]  # corpus JSONL files, concatenated in this order (teacher index space)
    output_dir: str  # checkpoints/ and final/ are written here
    teacher_files: list[str] = field(default_factory=list)  # {"i", "probs"} lines; i indexes train rows
    val_file: str | None = None  # validated on rank 0 in canonical order with the base instruction
    tokenizer: str | None = None  # defaults to base_model
    # Start adapter and head from this checkpoint (they keep training); it fixes INIT_FIXED_KEYS.
    init_from: str | None = None

    # --- model ----------------------------------------------------------------------------
    head_type: str = "pointer"  # pointer: any option count; slot: at most num_slots options
    pointer_dim: int = 64
    head_hidden: int = 0  # 0: linear query/key projections; >0: one GELU hidden layer of this width
    num_slots: int = 8
    head_ensemble: int = 1  # >1: that many heads, logits averaged (what a soup of N checkpoints holds)
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
    # pretrained: the weights in base_model. random: base_model's config.json alone, initialised by
    # from_config under `seed` on the training device (benchmarks and smoke tests: nothing to download).
    torso_init: str = "pretrained"
    freeze_torso: bool = False  # train the head alone (the LoRA adapter, if any, stays as loaded)
    # Gemma 3n/4: keep the per-layer embedding table in host memory (one process only, no torchrun).
    host_embeddings: bool = False

    # --- loss -----------------------------------------------------------------------------
    score_smoothing: float = 0.1  # ordinal smoothing epsilon for score rows
    kl_teacher_weight: float = 1.0
    kl_frozen_weight: float = 0.0  # KL to the frozen torso's option-letter readout
    kl_direction: str = "forward"  # forward: KL(target||model); reverse: KL(model||target)
    # The frozen-KL target is this checkpoint's own (calibrated) distribution instead of the frozen
    # torso's letter readout; it may have another torso and tokenizer (it renders rows its own way,
    # options in the same canonical slots). Needs precompute_frozen_kl: true.
    kl_frozen_reference: str | None = None
    # Compute every training row's frozen-KL target once before step 1 (canonical option order,
    # base instruction) instead of a second, adapter-disabled forward per micro-batch.
    precompute_frozen_kl: bool = False

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
    # The length micro-batches are grouped by. tokens: each row's rendered length in tokens (one
    # tokenizer pass at setup). chars: a tokenizer-free character count, the only key of earlier
    # versions (set it to resume their checkpoints). On the default run's data it left 24% of a
    # micro-batch's tokens as padding, against 7.5% for tokens (bench/train_throughput.py).
    length_group_by: str = "tokens"
    # End the run after this many optimizer steps, final/ written (None: every epoch's steps). The
    # learning-rate schedule spans these steps, so it is part of what a run computes (not run
    # control). Smoke runs and tests train a few steps on the full data this way.
    max_steps: int | None = None

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
    # The chunked rule of Gated DeltaNet layers (Qwen3.5): auto (fla's kernel when it imports and its
    # backward runs here, else torch), torch (the reference function), compiled (it, torch.compile'd).
    gated_delta_rule: str = "auto"
    # Every decoder layer under torch.compile (hobson.decider.compiling): fuses the elementwise work
    # around the matmuls on a GPU; the first steps of each length class pay the compile.
    compile_layers: bool = False
    # LoRA's forward (hobson.decider.fusion): peft's, or fused (the adapter's product in the torso's
    # dtype, its add inside the GEMM); auto: fused for a bf16 torso, peft's in fp32
    lora_kernel: str = "auto"
    # Norms, the gated norm and silu(gate) * up as one kernel each in a CUDA step: liger's Triton
    # kernels or hobson's compiled chains; auto: liger for a bf16 torso on CUDA where it imports;
    # eager (the model's own numbers) on a CPU
    chain_kernel: str = "auto"
    # Each micro-batch's forward, loss and backward as one CUDA graph replay (hobson.decider.graphs):
    # the host's ~20k launches per micro-batch become one. Micro-batches are padded to buckets: rows
    # to micro_batch_size, length to a multiple of graph_length_multiple (more padding, fewer
    # captures). One process, CUDA, no LoRA dropout.
    cuda_graphs: bool = False
    graph_length_multiple: int = 32
    trace_dir: str | None = None  # debug: per-step all-reduced gradients and rendered token ids

    def __post_init__(self) -> None:
        problems = []
        if self.head_type not in HEAD_TYPES:
            problems.append(f"head_type {self.head_type!r} is not one of {', '.join(HEAD_TYPES)}")
        if self.kl_direction not in KL_DIRECTIONS:
            problems.append(f"kl_direction {self.kl_direction!r} is not one of {', '.join(KL_DIRECTIONS)}")
        if self.length_group_by not in LENGTH_KEYS:
            problems.append(f"length_group_by {self.length_group_by!r} is not one of {', '.join(LENGTH_KEYS)}")
        if self.on_usr2 not in ON_USR2:
            problems.append(f"on_usr2 {self.on_usr2!r} is not one of {', '.join(ON_USR2)}")
        if self.device not in DEVICES:
            problems.append(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.gated_delta_rule not in GATED_DELTA_RULES:
            problems.append(f"gated_delta_rule {self.gated_delta_rule!r} is not one of {', '.join(GATED_DELTA_RULES)}")
        if self.lora_kernel not in LORA_KERNELS:
            problems.append(f"lora_kernel {self.lora_kernel!r} is not one of {', '.join(LORA_KERNELS)}")
        if self.chain_kernel not in CHAIN_KERNELS:
            problems.append(f"chain_kernel {self.chain_kernel!r} is not one of {', '.join(CHAIN_KERNELS)}")
        if self.torso_init not in TORSO_INITS:
            problems.append(f"torso_init {self.torso_init!r} is not one of {', '.join(TORSO_INITS)}")
        for key in ("epochs", "micro_batch_size", "grad_accum", "max_length", "pointer_dim", "num_slots",
                    "head_ensemble", "lora_r", "length_group_chunk", "val_batch_size", "log_every",
                    "graph_length_multiple"):
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
        for key in ("stop_after_steps", "max_steps"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                problems.append(f"{key} must be >= 1 or null, got {getattr(self, key)}")
        if not self.train_files:
            problems.append("train_files is empty; list at least one corpus JSONL file")
        if self.cuda_graphs and self.lora_dropout > 0:
            problems.append(f"cuda_graphs: true replays each micro-batch's kernels, and LoRA dropout's random draws "
                            f"would then depend on when a shape was captured; set lora_dropout: 0 (now "
                            f"{self.lora_dropout}) or cuda_graphs: false")
        if self.cuda_graphs and self.attn_implementation == "eager":
            # transformers' eager mask builder makes its 0.0 with torch.tensor(0.0, device=...), a
            # copy from host memory inside the step, which CUDA graph capture refuses (H100, session 25)
            problems.append("cuda_graphs: true cannot capture attn_implementation: eager (its mask builder "
                            "copies from the host inside the step); use attn_implementation: sdpa or "
                            "cuda_graphs: false")
        if self.cuda_graphs and self.host_embeddings:
            problems.append("cuda_graphs: true cannot replay host_embeddings' copies through host memory; "
                            "set one of them to false")
        if self.kl_frozen_reference and not self.precompute_frozen_kl:
            problems.append("kl_frozen_reference is computed once before step 1; set precompute_frozen_kl: true")
        if self.kl_frozen_reference and self.kl_frozen_weight <= 0:
            problems.append("kl_frozen_reference needs kl_frozen_weight > 0 (it is the frozen-KL target)")
        if self.freeze_torso and self.use_lora and not self.init_from:
            problems.append("freeze_torso with use_lora trains nothing but a head on a zero adapter; set "
                            "init_from: <checkpoint> (to keep its adapter) or use_lora: false")
        if self.bf16 and self.device == "cpu":
            problems.append("bf16 is for GPUs; set bf16: false for a CPU run (CPU trains in fp32)")
        if problems:
            raise ConfigError("; ".join(problems))


def load_train_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read ``path`` into a :class:`TrainConfig`, then apply ``key=value`` overrides (YAML values).

    An unknown key in the file or in an override is an error naming it (and the file and line).
    The keys the file or the overrides contain are remembered (:func:`explicit_keys`): with
    ``init_from`` a key *present* counts as set, even at its default value, and every such key
    that conflicts with the checkpoint is named in one error before any model is loaded.
    """
    cfg = load_config(path, TrainConfig)
    explicit = set(_yaml_keys(path))
    if overrides:
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
                explicit.add(key)
        if bad:
            raise ConfigError("invalid overrides for " + str(path) + ":\n  " + "\n  ".join(bad))
        cfg = config_from_dict(data, TrainConfig, origin=f"{path} (with overrides)")
    _set_explicit(cfg, explicit)
    return resolve_init_from(cfg, origin=str(path))


def _yaml_keys(path: str | os.PathLike) -> list[str]:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    return list(data) if isinstance(data, dict) else []


def _set_explicit(cfg: TrainConfig, keys: set[str] | frozenset[str]) -> None:
    # An attribute, not a field: it stays out of asdict(), config.json and resume checks.
    object.__setattr__(cfg, "_explicit_keys", frozenset(keys))


def explicit_keys(cfg: TrainConfig) -> frozenset[str]:
    """Keys the YAML file or overrides contained; for a config built in code, the keys whose value
    differs from the default (required keys included)."""
    known = getattr(cfg, "_explicit_keys", None)
    if known is not None:
        return known
    out = set()
    for f in dataclasses.fields(TrainConfig):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            out.add(f.name)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if getattr(cfg, f.name) != default:
            out.add(f.name)
    return frozenset(out)


# What a checkpoint fixes for a run that starts from it (init_from): the torso, the adapter's shape
# and the head's shape. max_length and tokenizer are taken from it unless the config sets them.
INIT_FIXED_KEYS = ("base_model", "num_slots", "head_type", "pointer_dim", "head_hidden", "use_lora", "lora_r",
                   "lora_alpha", "lora_targets", "force_bos")
INIT_TAKEN_KEYS = INIT_FIXED_KEYS + ("head_ensemble",)
INIT_DEFAULTED_KEYS = ("max_length", "tokenizer")


def _same(key: str, a: object, b: object) -> bool:
    if a == b:
        return True
    if key in ("base_model", "tokenizer") and isinstance(a, str) and isinstance(b, str):
        return os.path.realpath(a) == os.path.realpath(b)
    return False


def init_conflicts(saved: dict, cfg: TrainConfig) -> list[str]:
    """Keys of INIT_FIXED_KEYS present in the config with a value other than the checkpoint's."""
    explicit = explicit_keys(cfg)
    now = config_to_dict(cfg)
    return [f"{k}: checkpoint {saved.get(k)!r}, config {now[k]!r}" for k in INIT_FIXED_KEYS
            if k in explicit and k in saved and not _same(k, saved[k], now[k])]


def resolve_init_from(cfg: TrainConfig, origin: str = "config") -> TrainConfig:
    """With ``init_from``: refuse conflicting keys (all named at once), then take the checkpoint's
    fixed keys (and max_length/tokenizer unless set). Reads only the checkpoint's config.json."""
    if not cfg.init_from:
        return cfg
    import json

    path = os.path.join(cfg.init_from, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from {cfg.init_from}: not a decider checkpoint ({path}: {e})") from None
    conflicts = init_conflicts(saved, cfg)
    if conflicts:
        raise ConfigError(f"{origin}: init_from {cfg.init_from} fixes these keys, which the config sets to other "
                          "values:\n  " + "\n  ".join(conflicts)
                          + "\nremove them from the config (they are taken from the checkpoint) or set them "
                          "to the checkpoint's values")
    explicit = explicit_keys(cfg)
    updates = {k: saved[k] for k in INIT_TAKEN_KEYS if k in saved}
    updates.update({k: saved[k] for k in INIT_DEFAULTED_KEYS if k in saved and k not in explicit})
    data = config_to_dict(cfg)
    data.update(updates)
    resolved = config_from_dict(data, TrainConfig, origin=f"{origin} (init_from {cfg.init_from})")
    _set_explicit(resolved, explicit)
    return resolved


def config_to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def resume_conflicts(saved: dict, cfg: TrainConfig) -> list[str]:
    """Keys (outside RUN_CONTROL_KEYS) whose value differs from the checkpoint's config."""
    now = config_to_dict(cfg)
    keys = sorted((set(saved) | set(now)) - RUN_CONTROL_KEYS)
    saved = {**ADDED_KEYS, **saved}
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
