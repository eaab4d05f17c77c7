"""The one RL loop, shared by PPO, GRPO, DPPO and Flow-DPPO.

Reads top to bottom: set up (settings, resume checks, model, trainers, engine), then per update::

    publish the current weights as version v (v = updates done); the engine loads it
    rollout:  prompts[cursor:cursor+P] × C completions, one seed per request
    reward:   registered reward function per completion
    prepare:  critic values, advantages (registered estimator), frozen pre-update tensors
    train:    the registered objective, ``minibatches`` optimizer steps (+ the critic's)
    record:   rollouts/update-k.jsonl, publish v+1, checkpoint k, metrics, run.json

The algorithm only enters through :func:`hobson.rl.algorithms.get_algorithm` (objective and
estimator looked up by name). Output directory::

    run.json                      settings, revisions, latent profile, one entry per process
    publications/v{N:06d}/        policy weights + manifest (digest)
    rollouts/update-{k:06d}.jsonl tokens, behaviour log-probs, rewards, traces, (version, digest)
    checkpoints/update-{k:06d}/   actor, critic, optimizer/scheduler/scaler, RNG, cursor, version
    metrics.jsonl, metrics.png

``--stop-after N`` then ``--resume`` gives the same bits as one uninterrupted run: the resumed
process loads checkpoint N, republishes version N (its digest must equal the one on disk) before
its first rollout, restores the RNG states, and continues.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hobson import faults, rng
from hobson.devices import check_device
from hobson.errors import ConfigError, DigestMismatch, StageError
from hobson.io import atomic_write, check_writable_dir, dumps_row, read_jsonl, write_json_atomic
from hobson.models import get_provider, tiny_config
from hobson.models.common import fused_kernels, read_config
from hobson.models.huginn import check_latent_profile, initial_state, latent_profile
from hobson.progress import progress
from hobson.records import git_info, utc_now, versions
from hobson.rl import checkpoint as ckpt
from hobson.rl import data as rldata
from hobson.rl.algorithms import ADVANTAGE_PARAMS, Algorithm, get_algorithm
from hobson.rl.config import (
    PRECISIONS,
    TINY_PREFIX,
    RLConfig,
    check_conventions,
    check_resume,
    conventions,
    resolve_defaults,
)
from hobson.rl.metrics import MetricsLog
from hobson.rl.objectives import (
    aggregate,
    entropy,
    get_advantage,
    get_objective,
    tempered_logprobs,
    token_logprobs,
    value_loss,
)
from hobson.rl.reward import get_reward
from hobson.rl.trainer import ModelTrainer
from hobson.rollout import publication
from hobson.rollout.engine import Completion, forward_kwargs, is_recurrent_depth, request_seed
from hobson.threads import set_threads

TINY_SEED = 0  # the embedded tiny models' weights do not depend on --seed
TINY_BLOCK = 512  # room for 128 prompt + 48 new tokens and more


# ---------------------------------------------------------------------------------------------
# The batch the trainer sees


@dataclass
class Batch:
    """Right-padded sequences (prompt + completion) and per-token tensors ``(B, L-1)``.

    ``logits[:, t]`` of a forward on ``ids`` scores ``actions[:, t] = ids[:, t+1]``; ``mask`` is 1
    on completion tokens. ``seeds`` are the requests' seeds (Huginn replays their latents).
    """

    ids: Tensor
    actions: Tensor
    mask: Tensor  # what enters the loss and the whitening
    span: Tensor  # the response positions GAE runs over (today the same as mask)
    behav: Tensor
    rewards: Tensor
    group_ids: Tensor
    seeds: list[int]
    advantages: Tensor = field(default_factory=lambda: torch.zeros(0))
    returns: Tensor = field(default_factory=lambda: torch.zeros(0))
    old_values: Tensor = field(default_factory=lambda: torch.zeros(0))
    # Huginn's initial states (B, L, E) for these rows, drawn once per update: every training
    # forward of the update (recompute, each minibatch, actor and critic) would draw the same
    # vectors again on the host, about 0.4 s for 16 x 176 tokens with the GPU waiting
    latents: Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        """A copy with its tensors on ``device`` (sharing them when they are there already)."""
        move = lambda t: t.to(device, non_blocking=True)
        return Batch(
            ids=move(self.ids), actions=move(self.actions), mask=move(self.mask), span=move(self.span),
            behav=move(self.behav), rewards=move(self.rewards), group_ids=move(self.group_ids), seeds=self.seeds,
            advantages=move(self.advantages), returns=move(self.returns), old_values=move(self.old_values),
            latents=None if self.latents is None else move(self.latents),
        )

    def rows(self, idx: Tensor) -> Batch:
        """The rows ``idx`` (a host tensor, whatever device the batch is on)."""
        at = idx.to(self.ids.device)
        pick = lambda t: t[at] if t.numel() else t
        return Batch(
            ids=self.ids[at],
            actions=self.actions[at],
            mask=self.mask[at],
            span=self.span[at],
            behav=self.behav[at],
            rewards=self.rewards[at],
            group_ids=self.group_ids[at],
            seeds=[self.seeds[i] for i in idx.tolist()],
            advantages=pick(self.advantages),
            returns=pick(self.returns),
            old_values=pick(self.old_values),
            latents=None if self.latents is None else self.latents[at],
        )


def build_batch(
    prompts: list[list[int]],
    completions: list[Completion],
    rewards: list[float],
    group_ids: list[int],
    seeds: list[int],
    pad_id: int,
) -> Batch:
    B = len(prompts)
    L = max(len(p) + len(c.tokens) for p, c in zip(prompts, completions, strict=True))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros(B, L - 1)
    behav = torch.zeros(B, L - 1)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = p + c.tokens
        ids[b, : len(seq)] = torch.tensor(seq)
        # completion token j sits at len(p)+j and is scored by logits at len(p)+j-1
        mask[b, len(p) - 1 : len(seq) - 1] = 1
        behav[b, len(p) - 1 : len(seq) - 1] = torch.tensor(c.logprobs, dtype=torch.float32)
    return Batch(
        ids=ids,
        actions=ids[:, 1:],
        mask=mask,
        span=mask.clone(),
        behav=behav,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(group_ids),
        seeds=list(seeds),
    )


# ---------------------------------------------------------------------------------------------
# Set-up helpers


def recorded_model_revision(model_dir: Path) -> str | None:
    """The revision a model directory records: ``revision.txt``, a ``revision`` in config.json's
    ``_hobson``, or the HF cache layout ``.../snapshots/<sha>/``."""
    f = model_dir / "revision.txt"
    if f.exists():
        return f.read_text(encoding="utf-8").strip()
    rev = read_config(model_dir).get("_hobson", {}).get("revision")
    if rev:
        return str(rev)
    resolved = model_dir.resolve()
    if resolved.parent.name == "snapshots":
        return resolved.name
    return None


def resolve_revisions(cfg: RLConfig) -> tuple[str, str]:
    spec = cfg.model_spec
    if spec.startswith(TINY_PREFIX):
        recorded: str | None = f"{spec}:seed{TINY_SEED}"
    else:
        recorded = recorded_model_revision(Path(spec))
    if cfg.model_revision is not None and recorded is not None and cfg.model_revision != recorded:
        raise ConfigError(
            f"--model-revision {cfg.model_revision} but {spec} records revision {recorded}; refusing to mix them"
        )
    model_rev = cfg.model_revision or recorded or "unrecorded"
    engine_rev = cfg.engine_revision or f"hobson-{cfg.engine}-torch-{torch.__version__}"
    return model_rev, engine_rev


def build_models(cfg: RLConfig, critic: bool) -> tuple[Any, Any, torch.nn.Module, torch.nn.Module | None]:
    """(provider, model config, actor, critic) in fp32 on the training device; fp16 is DeepSpeed's cast."""
    spec = cfg.model_spec
    if spec.startswith(TINY_PREFIX):
        kind = spec[len(TINY_PREFIX) :]
        mcfg = tiny_config(kind, **({"block_size": TINY_BLOCK} if kind == "huginn_raven" else {}))
        provider = get_provider(mcfg)
        actor = provider.build_actor(mcfg, device=cfg.device, seed=TINY_SEED)
        crit = provider.build_critic(mcfg, device=cfg.device, seed=TINY_SEED + 1) if critic else None
    else:
        provider = get_provider(spec)
        mcfg = provider.config(spec)
        actor = provider.load(spec, device=cfg.device)
        crit = provider.load(spec, device=cfg.device, critic=True, seed=TINY_SEED + 1) if critic else None
    return provider, mcfg, actor, crit


def make_engine(cfg: RLConfig, provider: Any, tok: Any, model_rev: str, engine_rev: str) -> Any:
    """The rollout engine: in-process, or with ``engine_address_file`` a rollout server in another
    process or on another node (:class:`hobson.rollout.transport.RemoteEngine`, bit-identical)."""
    dtype = getattr(torch, PRECISIONS[cfg.rollout_precision or cfg.precision])
    device = cfg.engine_device or cfg.device
    if cfg.engine_address_file:
        from hobson.rollout.transport import RemoteEngine

        return RemoteEngine(
            cfg.engine_address_file,
            dtype_name=PRECISIONS[cfg.rollout_precision or cfg.precision],
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            model_revision=model_rev,
            engine_revision=engine_rev,
            torch_threads=torch.get_num_threads(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            request_timeout=cfg.engine_timeout,
            publish_timeout=cfg.publish_timeout,
            ready_timeout=cfg.engine_ready_timeout,
            transport=cfg.transport,
            bucket_bytes=max(1, int(cfg.weight_bucket_mb * 1024**2)),
            servers=cfg.rollout_servers,
        )
    if cfg.engine == "vllm":
        from hobson.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            provider,
            dtype=dtype,
            device=device,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            model_revision=model_rev,
            engine_revision=engine_rev,
        )
    from hobson.rollout.engine import NativeEngine

    return NativeEngine(
        provider,
        dtype=dtype,
        device=device,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        model_revision=model_rev,
        engine_revision=engine_rev,
    )


def apply_env_vars(pairs: list[str]) -> None:
    for kv in pairs:
        k, v = kv.split("=", 1)
        os.environ[k] = v
        if k == "OMP_NUM_THREADS":
            set_threads(int(v))  # torch read the variable at import; apply it now


# ---------------------------------------------------------------------------------------------
# One update's training step


def _device(trainer: ModelTrainer) -> torch.device:
    return next(trainer.module.parameters()).device


def _fwd(trainer: ModelTrainer, batch: Batch, with_grad: int, compiled: bool = False) -> Tensor:
    """Logits (or values) ``(B, L-1)`` on the trainer's device: the objectives run where the logits are.

    On a GPU, sending the ``(B, L-1, V)`` fp32 logits to the host and running log-softmax there
    (and the gradient back) cost more than the forward itself for Huginn's 65,536 tokens.
    """
    kwargs = forward_kwargs(trainer.module, batch.seeds, with_grad)
    if batch.latents is not None and "seed" in kwargs and batch.latents.shape[-1] == trainer.module.config.n_embd:
        kwargs["latent_state"] = batch.latents
    # compiled: the chains as compiled kernels for any length (``compiled_chains``; CUDA only, the
    # CPU stays eager); checkpointed blocks recompute under the same setting (``checkpointed``)
    dev = _device(trainer)
    with fused_kernels(on=compiled and dev.type == "cuda", dynamic=True):
        return trainer(batch.ids.to(dev), **kwargs)[:, :-1]


def _latents(model: torch.nn.Module, batch: Batch, device: torch.device) -> Tensor | None:
    """The initial states a forward of ``model`` on ``batch`` would draw (right-padded rows: positions
    0..L-1), or None for a model without them."""
    if not is_recurrent_depth(model):
        return None
    B, L = batch.ids.shape
    return initial_state(batch.seeds, torch.arange(L).expand(B, L), model.config.n_embd).to(device)


def _now() -> float:
    """Wall clock after the GPU's queued work (per-phase seconds would otherwise land in the next phase)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _reset_peaks() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for d in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(d)


def _peaks() -> dict[str, float]:
    """Peak memory allocated by this process on each GPU since the last reset, GiB."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {f"cuda:{d}": round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in range(torch.cuda.device_count())}


def train_on_rollout(
    alg: Algorithm, cfg: RLConfig, actor: ModelTrainer, critic: ModelTrainer | None, batch: Batch, backprop: int
) -> dict[str, Any]:
    """Advantages, frozen pre-update tensors, then ``alg.minibatches`` optimizer steps; returns metrics."""
    temp = cfg.temperature or 1.0
    actor.train()
    t0 = _now()
    dev, cc = _device(actor), cfg.compiled_chains
    on_dev = batch.to(dev)
    on_dev.latents = latents = _latents(actor.module, batch, dev)
    with torch.no_grad():
        logits = _fwd(actor, on_dev, 0, cc)
        trainer_lp = token_logprobs(logits, on_dev.actions, temp)
        frozen = alg.freeze(logits, on_dev, temp)
        ent = aggregate(entropy(tempered_logprobs(logits, temp)), on_dev.mask, cfg.loss_aggregation)
        # the advantage estimators run on the host, as the rollout's rewards are there
        batch.old_values = _fwd(critic, on_dev, 0, cc).cpu() if critic is not None else torch.zeros(0)
        del logits
    estimator = get_advantage(alg.advantage)
    batch.advantages, batch.returns = estimator(
        batch.rewards,
        batch.mask,
        values=batch.old_values if critic is not None else None,
        group_ids=batch.group_ids,
        span=batch.span,
        **ADVANTAGE_PARAMS[alg.advantage](cfg),
    )
    valid = batch.mask.bool()
    t_recompute = _now() - t0
    out: dict[str, Any] = {
        "entropy": float(ent),
        "logprob_diff_max": float((trainer_lp.cpu() - batch.behav).abs()[valid].max()) if valid.any() else 0.0,
        "adv_abs_mean": float(aggregate(batch.advantages.abs(), batch.mask, cfg.loss_aggregation)),
        "steps": [],
    }
    objective = get_objective(alg.objective)
    B = batch.ids.shape[0]
    on_dev = batch.to(dev)  # now with advantages, returns and old values
    on_dev.latents = latents
    for idx in torch.arange(B).chunk(alg.minibatches):
        mb = on_dev.rows(idx)
        fz = {k: v[idx.to(v.device)] for k, v in frozen.items()}
        logits = _fwd(actor, mb, backprop, cc)
        loss, m = objective(**alg.inputs(logits, fz, mb, temp), **alg.params(cfg), aggregation=cfg.loss_aggregation)
        actor.backward(loss)
        step = {"loss": float(loss.detach()), "grad_norm": actor.grad_norm(), **{k: float(v) for k, v in m.items()}}
        actor.step()
        if critic is not None:
            values = _fwd(critic, mb, backprop, cc)
            vloss, vm = value_loss(values, mb.old_values, mb.returns, mb.mask, value_clip=cfg.value_clip,
                                   aggregation=cfg.loss_aggregation)
            critic.backward(vloss)
            critic.step()
            step.update(value_loss=float(vloss.detach()), **{k: float(v) for k, v in vm.items()})
        out["steps"].append(step)
    out["seconds"] = {"recompute": t_recompute, "optimizer": _now() - t0 - t_recompute}
    for key in ("loss", "grad_norm", "approx_kl", "clipfrac", "ratio_mean", "gate_frac", "kl_mean", "value_loss"):
        vals = [s[key] for s in out["steps"] if key in s]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


# ---------------------------------------------------------------------------------------------
# The run


class RunRecord:
    """``<output>/run.json``: the run-record contract plus ``rl`` (settings and one entry per process)."""

    def __init__(self, output: Path) -> None:
        self.path = output / "run.json"
        self.meta: dict[str, Any] = {}
        self.session: dict[str, Any] = {}

    def start(self, cfg: RLConfig, argv: list[str], extra: dict[str, Any]) -> None:
        import json

        if cfg.resume:
            self.meta = json.loads(self.path.read_text(encoding="utf-8"))
        else:
            self.meta = {
                "run_id": self.path.parent.name,
                "run_dir": str(self.path.parent.resolve()),
                "kind": "rl",
                "created_utc": utc_now(),
                "command": argv,
                "cwd": os.getcwd(),
                "host": socket.gethostname(),
                "git": git_info(),
                "versions": versions(),
                "rl": {"settings": cfg.to_dict(), "conventions": conventions(cfg), **extra, "sessions": []},
            }
        self.session = {
            "session": len(self.meta["rl"]["sessions"]),
            "argv": argv,
            "started_utc": utc_now(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "resumed_from": None,
            "events": [],
            "updates_run": [],
        }
        self.meta["rl"]["sessions"].append(self.session)
        self.save()

    def event(self, kind: str, **info: Any) -> None:
        self.session["events"].append({"event": kind, **info})
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.meta)


def _newest_intact_checkpoint(out: Path, done: list[int]) -> tuple[int, dict[str, Any] | None, list[dict[str, Any]]]:
    """``(update, loaded state, set-aside events)`` of the newest checkpoint whose bytes verify.

    A corrupt or incomplete one (or one whose actor publication fails its digest) is renamed
    ``*.corrupt``, kept for inspection, and the next older one is tried; because a resume is
    exact, the run still ends with the uninterrupted result. None left intact is an error.
    """
    events = []
    for update in reversed(done):
        path = ckpt.checkpoint_dir(out, update)
        try:
            return update, ckpt.load_checkpoint(path), events
        except (ckpt.CheckpointCorrupt, DigestMismatch, publication.PublicationError) as e:
            aside = ckpt.set_aside(path)
            print(f"rl: checkpoint {path.name} is not intact: {e}; kept as {aside.name}, trying an older one",
                  flush=True)
            events.append({"update": update, "reason": str(e), "kept_as": str(aside.relative_to(out))})
    if events:
        raise StageError(
            f"--resume: no intact checkpoint left in {out / 'checkpoints'} (set aside: "
            f"{', '.join(e['kept_as'] for e in events)}); start the run again in a new --output "
            "(or keep more checkpoints: --keep-checkpoints)"
        )
    return 0, None, events


def remove_stale_temporaries(out: Path) -> list[str]:
    """Remove the temporary publication and checkpoint directories a killed process left behind.

    A publication or checkpoint is written to a hidden sibling and renamed into place; a process
    killed with SIGKILL (or by the node going away) cannot remove its sibling. Only one trainer
    writes a run at a time, so at start every hidden entry there is such a leftover.
    """
    gone = []
    for sub in ("publications", "checkpoints"):
        d = out / sub
        for p in sorted(d.glob(".*")) if d.is_dir() else []:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            gone.append(str(p.relative_to(out)))
    return gone


def _check_devices(cfg: RLConfig) -> None:
    import importlib.util

    if cfg.trainer == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        # (was an internal error at the first optimizer set-up, after the models were built)
        raise ConfigError("--trainer deepspeed (the default): the deepspeed package is not installed in this "
                          "Python; install the RL extra (pip install -e \".[rl]\"), or pass --trainer torch "
                          "(one process, plain torch)")
    check_device(cfg.device, "--device", "DEVICE in the sbatch scripts")
    if cfg.engine_address_file is None and cfg.engine_device:  # a remote server checks its own
        check_device(cfg.engine_device, "--engine-device", "ENGINE_DEVICE in the sbatch scripts")


def run(cfg: RLConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Run (or resume) the RL job ``cfg``; returns this process's session record."""
    return RLRecipe(cfg, list(sys.argv if argv is None else argv)).run()


@dataclass
class Rollout:
    """One update's requests and what came back."""

    prompts: list[list[int]]
    seeds: list[int]
    groups: list[int]
    rows: list[tuple[int, Any, int]]  # (prompt index, data row, completion index) per request
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


class RLRecipe:
    """The RL run, read top to bottom: :meth:`setup` (settings, resume checks, models, engine,
    trainers), :meth:`restore` (a checkpoint or the seed), then per update :meth:`rollout` ->
    :meth:`score` -> :meth:`train` (advantages and optimizer steps) -> :meth:`publish` ->
    :meth:`checkpoint` -> :meth:`log`."""

    def __init__(self, cfg: RLConfig, argv: list[str]) -> None:
        self.argv = argv
        if not cfg.resume:  # first: a device this torch or node cannot give is one message, no traceback
            _check_devices(cfg)  # (a resume first names every setting that differs from its run)
        self.cfg = resolve_defaults(cfg)  # VIME's defaults for this algorithm, model and device, recorded
        self.out = Path(self.cfg.output)
        check_writable_dir(self.out, "--output")
        self.secs: dict[str, float] = {}
        self.t_update = 0.0
        self.pub_secs: dict[str, float] = {}

    # ---- set-up ---------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, out = self.cfg, self.out
        apply_env_vars(cfg.train_env_vars)
        self.alg = get_algorithm(cfg.algorithm)
        self.data_path = Path(cfg.data) if cfg.data else rldata.DEFAULT_DATA
        rows = rldata.load_prompts(self.data_path)
        self.model_rev, self.engine_rev = resolve_revisions(cfg)
        self.dtype = getattr(torch, PRECISIONS[cfg.precision])
        # intra-op reductions may split differently with another thread count: part of the run's bits
        self.extra: dict[str, Any] = {"data_sha256": rldata.data_digest(self.data_path),
                                      "model_revision": self.model_rev, "engine_revision": self.engine_rev,
                                      "torch_threads": torch.get_num_threads()}
        self.record = RunRecord(out)
        meta = self._check_resume()  # before anything is written
        if cfg.resume:
            _check_devices(cfg)
        if any(str(d).startswith("cuda") for d in (cfg.device, cfg.engine_device or cfg.device)):
            # bit-exact resume on a GPU needs deterministic kernels (embedding backward uses atomics)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.provider, mcfg, actor_m, critic_m = build_models(cfg, self.alg.critic)
        recurrent = is_recurrent_depth(actor_m)
        if recurrent:
            self.extra["latent_profile"] = latent_profile(self.dtype)
            if cfg.resume:
                check_latent_profile(meta["latent_profile"], self.dtype)
        self.backprop = ((cfg.backprop_steps if cfg.backprop_steps is not None else mcfg.mean_backprop_depth)
                         if recurrent else 0)
        self.tok = rldata.tokenizer_for(
            None if cfg.model_spec.startswith(TINY_PREFIX) else cfg.model_spec, actor_m.config.vocab_size
        )
        # before the cursor counts rows: resume and the seeds' sample indices refer to the kept rows
        self.rows, dropped = rldata.drop_long_prompts(rows, self.tok, cfg.max_prompt_tokens, cfg.long_prompts,
                                                      self.data_path)
        self.engine = make_engine(cfg, self.provider, self.tok, self.model_rev, self.engine_rev)  # refuses early
        self.record.start(cfg, self.argv, self.extra)
        self.session = self.record.session
        self._record_setup_events(dropped)
        self._build_trainers(actor_m, critic_m)

    def _check_resume(self) -> dict[str, Any] | None:
        """The interrupted run's record (None for a new run), after refusing what would change its bits."""
        cfg, out, record = self.cfg, self.out, self.record
        self.start, self.resume_state, self.set_aside = 0, None, []
        if not cfg.resume:
            if (out / "run.json").exists():
                raise StageError(f"{out}: already holds a run; pass --resume to continue it or pick a new --output")
            return None
        if not record.path.exists():
            raise StageError(f"--resume: {record.path} is missing (nothing to resume)")
        import json

        meta = json.loads(record.path.read_text(encoding="utf-8"))["rl"]
        check_conventions(meta.get("conventions"), cfg)  # a run from before them first: the clearest reason
        check_resume(meta["settings"], cfg)
        changed = [f"{k}: run has {meta.get(k)!r}, now {v!r}" for k, v in self.extra.items() if meta.get(k) != v]
        if changed:
            raise ConfigError("--resume refuses inputs that differ from the interrupted run:\n  "
                              + "\n  ".join(changed))
        # no checkpoint yet (stopped during update 1): start over in the same directory
        self.start, self.resume_state, self.set_aside = _newest_intact_checkpoint(out, ckpt.list_checkpoints(out))
        finished = any(sess.get("finished_utc") and not sess.get("stopped_after") for sess in meta.get("sessions", []))
        if self.start >= cfg.updates and finished:
            raise StageError(f"--resume: the run already finished all {cfg.updates} updates")
        # all updates checkpointed but stopped before its final record (a signal after the last
        # update): the resume runs no update and writes the record and plots
        return meta

    def _record_setup_events(self, dropped: list[Any]) -> None:
        cfg, record = self.cfg, self.record
        for event in self.set_aside:
            record.event("checkpoint_corrupt", **event)
        if dropped:
            lines = [r.line for r in dropped]
            record.event("dropped_long_prompts", count=len(dropped), first_lines=lines[:10],
                         max_prompt_tokens=cfg.max_prompt_tokens)
            print(f"rl: left out {len(dropped)} of {len(self.rows) + len(dropped)} prompts longer than "
                  f"{cfg.max_prompt_tokens} tokens ({self.data_path} lines {', '.join(map(str, lines[:10]))}"
                  f"{', ...' if len(lines) > 10 else ''}); --long-prompts truncate keeps them", flush=True)
        stale = remove_stale_temporaries(self.out)
        if stale:
            record.event("removed_stale_temporaries", paths=stale)

    def _build_trainers(self, actor_m: torch.nn.Module, critic_m: torch.nn.Module | None) -> None:
        cfg = self.cfg
        trainer_args = dict(backend=cfg.trainer, precision=cfg.precision, optimizer=cfg.optimizer,
                            optimizer_args=cfg.optimizer_args, loss_scale=cfg.loss_scale,
                            micro_batch=cfg.prompts_per_update * cfg.completions_per_prompt,
                            recompute=cfg.recompute, grad_clip=cfg.grad_clip)
        self.actor = ModelTrainer(actor_m, lr=cfg.lr, **trainer_args)
        self.critic = (ModelTrainer(critic_m, lr=cfg.critic_lr or cfg.lr, **trainer_args)
                       if critic_m is not None else None)
        self.metrics = MetricsLog(self.out)
        self.pubs = self.out / "publications"
        self.reward_fn = get_reward(cfg.reward)
        self.writer = None if cfg.checkpoint_in_line else ckpt.CheckpointWriter(self.out)

    # ---- restore ------------------------------------------------------------------------------
    def restore(self) -> None:
        """Load the newest intact checkpoint (or seed a new run), then publish version ``start``."""
        cfg, out, session = self.cfg, self.out, self.session
        rng_after_publish = None
        if cfg.resume:
            self.metrics.keep_until(self.start)  # rows past the checkpoint are recomputed
        if self.start:
            path = ckpt.checkpoint_dir(out, self.start)
            state = self.resume_state
            ckpt.load_weights(self.actor.module, state["actor"], f"{path}/actor.safetensors")
            self.actor.load_state_dict(state["actor_trainer"])
            if self.critic is not None:
                ckpt.load_weights(self.critic.module, state["critic"], f"{path}/critic.safetensors")
                self.critic.load_state_dict(state["critic_trainer"])
            self.cursor = state["data_cursor"]
            session["resumed_from"] = str(path.relative_to(out))
            self.record.event("load_checkpoint", update=self.start, path=session["resumed_from"],
                              version=state["version"])
            rng_after_publish = state["rng"]
        else:
            self.cursor = 0
            rng.seed_everything(cfg.seed)
        self.version = self.start
        man = self.publish(self.version)  # a resumed run republishes its restored weights before the first rollout
        # does a publication hold exactly the actor's state dict? then checkpoints need not write the
        # actor again (see hobson.rl.checkpoint); one hash of the weights per session decides
        own = {k: v.detach() for k, v in self.actor.module.state_dict().items()}
        # (with --transport dist no publication is on disk: checkpoints hold the actor themselves,
        # written by the background writer, off the critical path)
        self.actor_in_publication = cfg.transport == "shared-dir" and publication.tensors_digest(own) == man.digest
        del own
        session["checkpoint_actor"] = "publication" if self.actor_in_publication else "own file"
        if rng_after_publish is not None:
            rng.restore(rng_after_publish)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.setup()
        try:
            self.restore()
            last = self.cfg.stop_after or self.cfg.updates
            for update in progress(range(self.start + 1, last + 1), desc=f"rl {self.cfg.algorithm} updates"):
                # a fault test lands its fault here: the previous checkpoint whole, this update not begun
                settle = None if self.writer is None else lambda: self.checkpoint_written(self.writer.wait())
                faults.hold(f"update-{update}", settle=settle)
                self.secs = {}
                self.t_update = _now()
                _reset_peaks()
                ro = self.rollout(update)
                self.score(ro)
                faults.hold(f"train-{update}")  # (fault tests: a signal between the phases of an update)
                batch, stats = self.train(update, ro)
                self.write_rollouts(update, ro, batch)
                faults.hold(f"publish-{update}")
                man = self.publish_update(update)
                faults.hold(f"checkpoint-{update}")
                background = False
                if update % self.cfg.checkpoint_every == 0 or update == last:
                    background = self.checkpoint(update, man)
                faults.hold(f"log-{update}")  # a background checkpoint may still be being written here
                self.log(update, ro, stats, background)
            faults.hold("finish")
            self.finish()
        except BaseException:
            # a failed or terminated run still finishes the checkpoint in flight (a whole checkpoint is
            # worth keeping, and a resume starts from it); a failure there must not hide this one
            if self.writer is not None:
                with contextlib.suppress(Exception):
                    self.writer.wait()
            raise
        finally:
            self.engine.close()
        return self.session

    def rollout(self, update: int) -> Rollout:
        cfg = self.cfg
        t0 = _now()
        ro = Rollout([], [], [], [])
        for i, (abs_idx, row) in enumerate(rldata.batch_rows(self.rows, self.cursor, cfg.prompts_per_update)):
            ptoks = rldata.encode_prompt(self.tok, row.prompt, cfg.max_prompt_tokens)
            for j in range(cfg.completions_per_prompt):
                ro.prompts.append(ptoks)
                # VIME's rollout_id = update - 1 and sample index = (rollout_id * prompts + i) *
                # completions + j, which is abs_idx * completions + j: the cursor moves by whole updates
                ro.seeds.append(request_seed(cfg.seed, update - 1, abs_idx * cfg.completions_per_prompt + j))
                ro.groups.append(i)
                ro.rows.append((abs_idx, row, j))
        self.record.event("rollout", update=update, version=self.engine.version)
        size = cfg.rollout_unit or len(ro.prompts)
        units = [(ro.prompts[k : k + size], ro.seeds[k : k + size]) for k in range(0, len(ro.prompts), size)]
        if hasattr(self.engine, "generate_units"):  # remote: the units spread over the servers
            parts = self.engine.generate_units(units, cfg.temperature, cfg.max_new_tokens)
        else:
            parts = [self.engine.generate(p, s, cfg.temperature, cfg.max_new_tokens) for p, s in units]
            if (cfg.engine_device or cfg.device) == cfg.device and hasattr(self.engine, "release"):
                # the trainer needs the engine's KV cache and graph memory on its own GPU; an engine
                # on another device keeps them, and its next rollout replays the graph it has
                self.engine.release()
        ro.completions = [c for part in parts for c in part]
        self.secs["rollout"] = _now() - t0
        return ro

    def score(self, ro: Rollout) -> None:
        t0 = time.perf_counter()
        for c, (_, row, _) in zip(ro.completions, ro.rows, strict=True):
            text_ids = [t for t in c.tokens if t != self.tok.eos_id]
            ro.rewards.append(float(self.reward_fn(self.tok.decode(text_ids), c.tokens, row.label)))
        self.secs["reward"] = time.perf_counter() - t0

    def train(self, update: int, ro: Rollout) -> tuple[Batch, dict[str, Any]]:
        """Advantages and the algorithm's optimizer steps on this update's rollout."""
        t0 = _now()
        batch = build_batch(ro.prompts, ro.completions, ro.rewards, ro.groups, ro.seeds, self.tok.pad_id)
        stats = train_on_rollout(self.alg, self.cfg, self.actor, self.critic, batch, self.backprop)
        self.secs["train"] = _now() - t0
        self.secs.update(stats.pop("seconds"))
        self.record.event("update", update=update, optimizer_steps=len(stats["steps"]))
        return batch, stats

    def write_rollouts(self, update: int, ro: Rollout, batch: Batch) -> None:
        with atomic_write(self.out / "rollouts" / f"update-{update:06d}.jsonl") as f:
            for b, (c, (abs_idx, row, j)) in enumerate(zip(ro.completions, ro.rows, strict=True)):
                mask = batch.mask[b].bool()
                f.write(dumps_row({
                    "update": update, "prompt_index": abs_idx, "data_line": row.line, "completion_index": j,
                    "seed": ro.seeds[b], "prompt_tokens": ro.prompts[b], "tokens": c.tokens,
                    "logprobs": c.logprobs, "reward": ro.rewards[b],
                    "advantage": float(batch.advantages[b][mask].mean()) if batch.mask[b].any() else 0.0,
                    "version": c.version, "digest": c.digest, "trace": c.trace,
                    # a remote engine's node; absent in-process (the file stays as it was)
                    **({"engine_node": c.node} if c.node is not None else {}),
                    **({"engine_server": c.server, "engine_pid": c.pid} if c.server is not None else {}),
                }) + "\n")

    # ---- publication and checkpoint -------------------------------------------------------------
    def publish(self, version: int) -> publication.Manifest:
        """Version ``version`` to the engine: written to disk then loaded (shared-dir), or from
        memory (dist: no file; a resumed run's first version must give its checkpoint's digest)."""
        cfg = self.cfg
        t0 = _now()
        resent = 0
        if cfg.transport == "shared-dir":
            man = publication.publish(self.provider, self.actor.module, self.pubs, version, dtype=self.dtype,
                                      model_revision=self.model_rev, engine_revision=self.engine_rev)
            t1 = _now()
            self.engine.load_publication(publication.version_dir(self.pubs, version))
        else:
            staged = publication.stage(self.provider, self.actor.module, version, dtype=self.dtype,
                                       model_revision=self.model_rev, engine_revision=self.engine_rev)
            man = staged.manifest
            want = (self.resume_state or {}).get("digest") if version == self.start and self.start else None
            if want is not None and want != man.digest:
                raise DigestMismatch(f"{ckpt.checkpoint_dir(self.out, version)}: version {version} was {want}; "
                                     f"the restored weights give {man.digest}")
            t1 = _now()
            before = len(getattr(self.engine, "resent", []))
            self.engine.load_staged(staged)
            resent = len(getattr(self.engine, "resent", [])) - before
            del staged
        t2 = _now()
        self.prune_publications()  # only once the engine serves the new version may older weights go
        self.pub_secs.update(publish_write=t1 - t0, engine_load=t2 - t1)
        self.record.event("publish", version=version, digest=man.digest, transport=cfg.transport,
                          seconds=round(t2 - t0, 4), **({"resent": resent} if resent else {}))
        return man

    def publish_update(self, update: int) -> publication.Manifest:
        t0 = time.perf_counter()
        self.cursor += self.cfg.prompts_per_update
        self.version = update
        man = self.publish(self.version)
        self.secs["publish"] = _now() - t0
        self.secs.update(self.pub_secs)
        return man

    def checkpoint(self, update: int, man: publication.Manifest) -> bool:
        """Checkpoint ``update`` (in the background when there is room for the copy); True if so."""
        t0 = _now()
        state = {"actor_trainer": self.actor.state_dict(), "data_cursor": self.cursor, "version": self.version,
                 "digest": man.digest, "settings": self.cfg.to_dict()}
        if self.critic is not None:
            state["critic_trainer"] = self.critic.state_dict()
        args: dict[str, Any] = dict(
            actor=self.actor.module, critic=self.critic.module if self.critic else None, state=state,
            actor_publication=str(publication.version_dir(self.pubs, self.version).relative_to(self.out))
            if self.actor_in_publication else None,
        )
        background = False
        if self.writer is not None:
            self.checkpoint_written(self.writer.wait())  # one copy at a time
            self.secs["checkpoint_wait"] = _now() - t0
            try:
                self.writer.submit(update, ckpt.capture(update, **args))
                background = True
            except torch.OutOfMemoryError:  # no room for the copy beside training: write it now
                _empty_cache()
                self.record.event("checkpoint_in_line", update=update, reason="out of memory for the copy")
        if not background:
            ckpt.save_checkpoint(self.out, update, **args)
            self.checkpoint_written(None)
        self.secs["checkpoint"] = _now() - t0
        path = ckpt.checkpoint_dir(self.out, update)
        self.record.event("checkpoint", update=update, path=str(path.relative_to(self.out)), background=background)
        return background

    def checkpoint_written(self, done: tuple[int, Path, float] | None) -> None:
        # a checkpoint is whole: older ones (and the versions only they read) may go
        if done is not None:
            self.record.event("checkpoint_written", update=done[0], path=str(done[1].relative_to(self.out)),
                              seconds=round(done[2], 4))
        if ckpt.prune_checkpoints(self.out, self.cfg.keep_checkpoints):
            self.prune_publications()

    def prune_publications(self) -> None:
        # never the weights of a version a kept checkpoint may read its actor from (version k is
        # checkpoint k's), whatever this session decides below: a resume's first publication
        # prunes before that, and a run that published v(n+1) but stopped before checkpoint n+1
        # resumes from checkpoint n (and the checkpoint being written in the background reads its
        # version too)
        writer = self.writer
        pending = {writer.pending} if writer is not None and writer.pending is not None else set()
        publication.prune(self.pubs, self.cfg.keep_publications, set(ckpt.list_checkpoints(self.out)) | pending)

    # ---- log and finish -----------------------------------------------------------------------
    def log(self, update: int, ro: Rollout, stats: dict[str, Any], background: bool) -> None:
        self.session["updates_run"].append(update)
        n_tokens = sum(len(c.tokens) for c in ro.completions)
        # the update's wall time, and the share of it spent outside rollout (first request to last
        # completion) and optimization (first training forward, recompute included, to the last
        # step): weight sync, checkpoint waits, rewards, writing rollouts
        self.secs["update"] = _now() - self.t_update
        busy = self.secs.get("rollout", 0.0) + self.secs.get("train", 0.0)
        row = {
            "update": update,
            "version": self.version,
            "reward_mean": sum(ro.rewards) / len(ro.rewards),
            "tokens": n_tokens,
            "tokens_per_s": n_tokens / max(self.secs["rollout"], 1e-9),
            "seconds": {k: round(v, 4) for k, v in self.secs.items()},
            "outside_share": round(max(0.0, 1.0 - busy / max(self.secs["update"], 1e-9)), 4),
            **({"peak_memory_gib": _peaks()} if _peaks() else {}),
            **{k: v for k, v in stats.items() if k != "steps"},
            "steps": stats["steps"],
        }
        self.metrics.append(row)
        keys = ("update", "reward_mean", "approx_kl", "clipfrac", "entropy", "tokens_per_s")
        print(dumps_row({k: row[k] for k in keys if k in row}), flush=True)

    def finish(self) -> None:
        if self.writer is not None:
            self.checkpoint_written(self.writer.wait())  # the run is done once its last checkpoint is whole
        self.metrics.plot()
        self.metrics.close()
        cfg = self.cfg
        self.session["finished_utc"] = utc_now()
        self.session["stopped_after"] = cfg.stop_after if cfg.stop_after and cfg.stop_after < cfg.updates else None
        self.record.save()


def read_rollouts(output: str | os.PathLike, update: int) -> list[dict[str, Any]]:
    return read_jsonl(Path(output) / "rollouts" / f"update-{update:06d}.jsonl")
