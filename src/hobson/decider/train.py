"""The decider training recipe (read top to bottom): setup, train, save, cleanup.

One process or ``torchrun --nproc_per_node=N``: every optimizer step trains the same rows, in the
same micro-batches, rendered token for token the same, as one process does.

- The one-process schedule (:class:`~hobson.decider.sampler.LengthGroupedSampler`) defines each
  step's micro-batches. Every rank computes it; :func:`~hobson.decider.sampler.assign_micro_batches`
  gives each micro-batch, whole, to one rank (balanced by padded size). A rank collates its own
  micro-batches and :meth:`~hobson.decider.collate.Collator.skip` s the others', in step order,
  so all collators draw the same option orders and phrasings as one process would.
- A rank scales its summed loss by ``world_size / rows_in_step``; DDP averages gradients over
  ranks, so the all-reduced gradient is ``sum over the step's rows / rows_in_step``: exactly the
  one-process gradient. Gradients sync once per step (``no_sync`` on a rank's earlier
  micro-batches); a rank with no micro-batch backpropagates a zero touching every trainable
  parameter so it still joins the all-reduce.
- Rank 0 validates, saves and logs. A checkpoint is written every ``checkpoint_every`` steps and
  at the step boundary after a SIGUSR2 (the handler only sets a flag; ranks agree on it through
  the per-step metrics all-reduce), then the run exits with :data:`PREEMPT_EXIT_CODE` or
  continues (``on_usr2``). A fresh process resumes from the newest checkpoint.
- After every optimizer step the recipe hands ``on_step`` (a constructor argument; benchmarks
  and tests use it) a :class:`StepStats`: the step's rows, real and padded tokens (every rank's,
  the numbers one process has) and its wall seconds. TensorBoard gets the same figures.
- ``gated_delta_rule`` selects the Gated DeltaNet kernel from setup to cleanup
  (:mod:`hobson.decider.kernels`); :attr:`DeciderTrainRecipe.kernels` says which one ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hobson import faults, rng
from hobson.attention import varying_shape_sdpa
from hobson.decider.checkpoint import (
    load_checkpoint,
    newest_intact_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_dir,
)
from hobson.decider.collate import Batch, Collator, to_canonical, token_lengths
from hobson.decider.compiling import compile_decoder_layers
from hobson.decider.config import TrainConfig, config_to_dict, resume_conflicts
from hobson.decider.graphs import MicroBatchGraphs
from hobson.decider.kernels import KernelChoice, select_gated_delta_rule
from hobson.decider.loss import decider_loss, masked_log_softmax
from hobson.decider.model import Decider, build_decider
from hobson.decider.sampler import LengthGroupedSampler, assign_micro_batches, row_length
from hobson.devices import check_device
from hobson.errors import ConfigError, DataError
from hobson.io import atomic_write, check_writable_dir, iter_jsonl, write_json_atomic
from hobson.models.common import fused_kernels
from hobson.progress import Progress
from hobson.scalars import TensorBoardLog
from hobson.threads import set_threads

# EX_TEMPFAIL: "try again later". A job script that sees it requeues instead of failing.
PREEMPT_EXIT_CODE = 75
# Summed over a step's micro-batches, then over ranks (one all-reduce per step).
_METRICS = ("loss", "ce", "kl_teacher", "kl_frozen", "correct", "rows", "usr2", "tokens", "padded_tokens",
            "attended_pairs")
_SUMMED = ("loss", "ce", "kl_teacher", "kl_frozen", "correct", "rows")  # what each micro-batch's loss reports


@dataclass(frozen=True)
class StepStats:
    """One optimizer step, as ``on_step`` receives it; counts are over every rank's micro-batches."""

    step: int
    epoch: int
    rows: int
    tokens: int  # real tokens (the attention mask's ones)
    padded_tokens: int  # tokens the forwards computed: rows x the micro-batch's longest row, summed
    # sum over rows of L * (L + 1) / 2: the (query, key) pairs causal attention scores over real tokens
    attended_pairs: int
    seconds: float  # this rank's wall seconds: collation to optimizer step, the device synchronised


def idle_ranks(world_size: int, grad_accum: int) -> int:
    """Ranks with no micro-batch in any step: a step's ``grad_accum`` micro-batches are whole
    units of work, handed to ranks (``assign_micro_batches``), never split between them."""
    return max(0, world_size - grad_accum)


def read_training_rows(paths: list[str]) -> list[dict[str, Any]]:
    """The concatenated training rows (their position is the teacher index ``i``)."""
    try:
        from hobson.corpus.schema import read_rows
    except ImportError:  # the corpus package is optional for this module
        def read_rows(path):
            return [row for _, row in iter_jsonl(path)]
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(read_rows(path))
    return rows


def read_teacher(paths: list[str], rows: list[dict[str, Any]]) -> dict[int, list[float]]:
    """``{i: probs}`` from teacher/replay files; ``i`` indexes the concatenated training rows."""
    teacher: dict[int, list[float]] = {}
    where: dict[int, str] = {}
    for path in paths:
        for lineno, obj in iter_jsonl(path):
            at = f"{path}:{lineno}"
            if not isinstance(obj, dict) or not isinstance(obj.get("i"), int) or not isinstance(obj.get("probs"), list):
                raise DataError(f"{at}: a teacher line must be {{\"i\": int, \"probs\": [...]}}, got {obj!r:.80}")
            i, probs = obj["i"], obj["probs"]
            if not 0 <= i < len(rows):
                raise DataError(f"{at}: i={i} is outside the {len(rows)} training rows")
            if i in teacher:
                raise DataError(f"{at}: i={i} already has teacher probabilities from {where[i]}")
            if len(probs) != len(rows[i]["options"]):
                raise DataError(f"{at}: {len(probs)} probs for training row {i} with {len(rows[i]['options'])} options")
            teacher[i], where[i] = [float(p) for p in probs], at
    return teacher


def lr_lambda(total_steps: int, warmup_steps: int, min_lr_ratio: float):
    """Linear warmup from 0 to 1 over ``warmup_steps``, then linear decay to ``min_lr_ratio``."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(1, total_steps - warmup_steps)
        return 1.0 - (1.0 - min_lr_ratio) * min(1.0, (step - warmup_steps) / span)
    return f


class DeciderTrainRecipe:
    """``__init__`` fails fast on settings; ``setup``; ``train`` returns the exit code; ``cleanup``."""

    def __init__(self, cfg: TrainConfig, on_step: Callable[[StepStats], None] | None = None,
                 compile_backend: str = "inductor") -> None:
        self.cfg = cfg
        self.on_step = on_step  # called on every rank after each optimizer step
        self.compile_backend = compile_backend  # torch.compile's backend (tests: "eager", no code generation)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_main = self.rank == 0
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        if cfg.device == "cuda":
            check_device("cuda", "device", "the training config")
        self.device = torch.device(f"cuda:{self.local_rank}" if use_cuda else "cpu")
        if cfg.bf16 and self.device.type == "cpu":
            raise ConfigError("bf16 is for GPUs; set bf16: false for a CPU run (CPU trains in fp32)")
        if cfg.host_embeddings and self.world_size > 1:
            raise ConfigError(f"host_embeddings: true keeps the per-layer embedding table in this process's host "
                              f"memory and works in one process only, but WORLD_SIZE={self.world_size} "
                              "(torchrun); set host_embeddings: false or run one process")
        if cfg.cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"cuda_graphs: true replays CUDA graphs, but this run trains on {self.device}; "
                              "set cuda_graphs: false")
        if cfg.cuda_graphs and self.world_size > 1:
            raise ConfigError(f"cuda_graphs: true runs in one process, but WORLD_SIZE={self.world_size} (torchrun): "
                              "DDP's gradient all-reduce runs inside the backward; set cuda_graphs: false")
        if cfg.num_threads:
            set_threads(cfg.num_threads)
        for key in ("base_model", "tokenizer"):  # local directories (no model hub): say so before any work
            where = getattr(cfg, key)
            if where and not (Path(where) / "config.json").is_file() and not (Path(where) / "tokenizer.json").is_file():
                raise ConfigError(f"{key}: {where} is not a model directory (no config.json or tokenizer.json there); "
                                  "set it to a local Hugging Face model directory")
        for key in ("train_files", "teacher_files", "val_file"):
            files = getattr(cfg, key)
            missing = [f for f in ([files] if isinstance(files, str) else files or []) if not Path(f).is_file()]
            if missing:
                raise ConfigError(f"{key}: {', '.join(missing)}: no such file; fix the path in the training config")
        check_writable_dir(cfg.output_dir, "output_dir:")
        self.output_dir = Path(cfg.output_dir)
        self.checkpoint_root = self.output_dir / "checkpoints"
        self._tb: TensorBoardLog | None = None  # opened at the first logged step (rank 0), after a resume
        self._tick: tuple[float, int] = (time.perf_counter(), 0)  # (time, tokens) at the last logged step
        self._usr2 = False
        self._old_handler = None
        if threading.current_thread() is threading.main_thread():
            # Only set a flag here: the checkpoint is written at the next step boundary, where
            # every rank is between collectives.
            self._old_handler = signal.signal(signal.SIGUSR2, self._on_usr2)
        self._own_process_group = False
        self._contexts = contextlib.ExitStack()  # held from setup to cleanup (the kernel selection)
        self.kernels: KernelChoice | None = None

    def _on_usr2(self, signum, frame) -> None:
        self._usr2 = True

    # --- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        self._setup_distributed()
        self.resume_from = self._choose_resume()
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
        self._setup_lr_scheduler()
        self._resume()

    def _setup_distributed(self) -> None:
        if self.world_size > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
            self._own_process_group = True

    def _choose_resume(self) -> Path | None:
        """The newest checkpoint whose bytes verify (corrupt ones set aside); rank 0 decides and
        every rank loads the same one."""
        if not self.cfg.resume:
            return None
        choice: list[str | None] = [None]
        if self.is_main:
            try:
                path, _ = newest_intact_checkpoint(self.checkpoint_root, log=self._log)
                choice = [str(path) if path else None]
            except DataError as e:
                choice = [f"!{e}"]
        if self.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        if choice[0] and choice[0].startswith("!"):
            raise DataError(choice[0][1:])
        return Path(choice[0]) if choice[0] else None

    def _setup_data(self) -> None:
        from transformers import AutoTokenizer

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.base_model)
        self.rows = read_training_rows(cfg.train_files)
        teacher = read_teacher(cfg.teacher_files, self.rows)
        self.collator = Collator(self.tokenizer, max_length=cfg.max_length, force_bos=cfg.force_bos,
                                 seed=cfg.seed, teacher=teacher)
        if cfg.length_group_by == "tokens":
            self.lengths = token_lengths(self.tokenizer, self.rows, max_length=cfg.max_length,
                                         force_bos=cfg.force_bos)
        else:
            self.lengths = [row_length(r) for r in self.rows]
        self.sampler = LengthGroupedSampler(self.lengths, micro_batch_size=cfg.micro_batch_size,
                                            grad_accum=cfg.grad_accum, epochs=cfg.epochs, seed=cfg.seed,
                                            chunk=cfg.length_group_chunk)
        self.val_rows = read_training_rows([cfg.val_file]) if cfg.val_file and self.is_main else []

    def _setup_model(self) -> None:
        self.model: Decider = build_decider(self.cfg, self.tokenizer, self.device)
        self.kernels = self._contexts.enter_context(
            select_gated_delta_rule(self.model.torso, self.cfg.gated_delta_rule, self.device,
                                    compile_backend=self.compile_backend, opaque=self.cfg.compile_layers))
        self._log({"chain_kernel": self.model.chain_kernel})
        if self.kernels is not None:  # only for torsos with Gated DeltaNet layers
            self._log({"gated_delta_rule": {k: v for k, v in self.kernels.as_dict().items() if k != "calls"}})
        if self.cfg.compile_layers:  # before DDP wraps the model: DDP then sees the compiled layers
            n = compile_decoder_layers(self.model.torso, backend=self.compile_backend)
            self._log({"compile_layers": {"layers": n, "backend": self.compile_backend}})
        if self.cfg.init_from and self.resume_from is None:  # a resumed run loads its own newer weights instead
            init = load_checkpoint(self.cfg.init_from, trainer_state=False)
            self.model.load_adapter_state(init.adapter)
            self.model.head.load_state_dict(init.head)
            self._log({"init_from": self.cfg.init_from})
        self.frozen_targets: dict[int, list[float]] | None = None
        if self.cfg.precompute_frozen_kl and self.cfg.kl_frozen_weight > 0:
            self.frozen_targets = self._precompute_frozen_targets()
            self.model.compute_frozen = False
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            idle = idle_ranks(self.world_size, self.cfg.grad_accum)
            if idle and self.is_main:  # stderr: the log's lines are what runs are compared by
                sys.stderr.write(f"hobson: warning: grad_accum {self.cfg.grad_accum} is fewer micro-batches per "
                                 f"step than the {self.world_size} ranks, so {idle} of them wait every step; set "
                                 f"grad_accum to a multiple of {self.world_size} (and micro_batch_size to keep "
                                 f"the rows per step) to use them all\n")

            # Every rank built identical weights from the same seed; buffers never change.
            self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                           broadcast_buffers=False)
        else:
            self.ddp = self.model
        self.graphs: MicroBatchGraphs | None = None
        if self.cfg.cuda_graphs:
            pad_id = self.collator.pad_id
            self.graphs = MicroBatchGraphs(self._micro_batch, self.params, self.device, rows=self.cfg.micro_batch_size,
                                           length_multiple=self.cfg.graph_length_multiple, pad_id=pad_id)

    @torch.no_grad()
    def _precompute_frozen_targets(self) -> dict[int, list[float]]:
        """Every training row's frozen-KL target, canonical order, computed once before step 1.

        From ``kl_frozen_reference`` (that checkpoint's calibrated distribution, rendered with its
        own tokenizer and settings) or else from the frozen torso's option-letter readout. Every
        rank computes the same targets from the same rows in the same batches.
        """
        from hobson.decider.predict import load_decider, predict_logits, probabilities, softmax

        cfg = self.cfg
        if cfg.kl_frozen_reference:
            ref = load_decider(cfg.kl_frozen_reference, self.device)
            probs = probabilities(predict_logits(ref, self.rows, cfg.val_batch_size), self.rows, ref.temperatures)
            del ref
        else:
            collator = Collator(self.tokenizer, max_length=cfg.max_length, force_bos=cfg.force_bos, seed=0,
                                shuffle=False)
            order = sorted(range(len(self.rows)), key=lambda i: (self.lengths[i], i))
            probs = [None] * len(self.rows)
            self.model.eval()
            for start in range(0, len(order), cfg.val_batch_size):
                idx = order[start:start + cfg.val_batch_size]
                batch = collator.collate([(i, self.rows[i]) for i in idx]).to(self.device)
                logits = self.model.frozen_logits(batch)
                for b, i in enumerate(idx):
                    probs[i] = softmax(logits[b, : len(self.rows[i]["options"])].double().cpu().tolist())
            self.model.train()
        self._log({"frozen_targets": len(probs), "from": cfg.kl_frozen_reference or "frozen torso"})
        return dict(enumerate(probs))

    def _frozen_logits(self, batch: Batch) -> torch.Tensor:
        """Log of the precomputed targets as ``(B, N)`` canonical-order logits (padding 0, masked),
        on the host."""
        out = torch.zeros(batch.option_mask.shape, dtype=torch.float32)
        for b, i in enumerate(batch.row_index):
            p = torch.tensor(self.frozen_targets[i], dtype=torch.float32).clamp(min=1e-12)
            out[b, : p.numel()] = p.log()
        return out

    def _setup_optimizer(self) -> None:
        cfg = self.cfg
        # fused on CUDA: one kernel over every tensor where foreach launches a dozen per chunk of
        # tensors, host time a host-bound step pays; CPU keeps torch's default
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay, fused=self.device.type == "cuda" or None)

    def _setup_lr_scheduler(self) -> None:
        cfg = self.cfg
        self.total_steps = min(self.sampler.total_steps(), cfg.max_steps or self.sampler.total_steps())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, cfg.warmup_steps, cfg.min_lr_ratio))

    def _resume(self) -> None:
        latest = self.resume_from
        if latest is None:
            return
        ckpt = load_checkpoint(latest)
        conflicts = resume_conflicts(ckpt.config, self.cfg)
        if conflicts:
            raise ConfigError(f"cannot resume from {latest}: the config differs in\n  " + "\n  ".join(conflicts)
                              + "\nrestore these keys, or set resume: false (or another output_dir)")
        state = ckpt.trainer_state
        self.model.load_adapter_state(ckpt.adapter)
        self.model.head.load_state_dict(ckpt.head)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.collator.load_state_dict(state["collator"])
        rngs = state["rng"]
        if self.rank < len(rngs):
            rng.restore(rngs[self.rank])
        self._log({"resumed_from": str(latest), "step": self.sampler.global_step()})

    # --- training ------------------------------------------------------------------------------
    def train(self) -> int:
        cfg = self.cfg
        saved_at = self.sampler.global_step() if self.resume_from is not None else -1
        bar = Progress(self.total_steps, "train steps") if self.is_main else None
        if bar is not None:
            bar.set(self.sampler.global_step())
        for epoch, _, micro in self.sampler:
            if self.sampler.global_step() >= self.total_steps:  # max_steps reached: final/ below
                break
            step = self.sampler.global_step() + 1
            if bar is not None and step > 1:
                bar.set(step - 1)
            # a fault test's USR2 lands before this step (and ends the hold)
            faults.hold(f"train-step-{step}", until=lambda: self._usr2)
            start = time.perf_counter()
            sums, grad_norm = self._train_step(step, micro)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the step's seconds are the device's, not the launches'
            seconds = time.perf_counter() - start
            self.sampler.advance()
            sums[_METRICS.index("usr2")] = float(self._usr2)
            if self.world_size > 1:
                sums = sums.to(self.device)  # NCCL reduces device tensors only
                dist.all_reduce(sums)
            m = dict(zip(_METRICS, sums.tolist(), strict=True))
            stats = StepStats(step=step, epoch=epoch, rows=int(m["rows"]), tokens=int(m["tokens"]),
                              padded_tokens=int(m["padded_tokens"]), attended_pairs=int(m["attended_pairs"]),
                              seconds=seconds)
            if self.on_step is not None:
                self.on_step(stats)
            tokens = self._tick[1] + stats.tokens
            self._tick = (self._tick[0], tokens)
            if step % cfg.log_every == 0 or step == self.total_steps:
                rows = m["rows"]
                row = {"step": step, "epoch": epoch, "loss": m["loss"] / rows, "ce": m["ce"] / rows,
                       "kl_teacher": m["kl_teacher"] / rows, "kl_frozen": m["kl_frozen"] / rows,
                       "acc": m["correct"] / rows, "rows": int(rows), "grad_norm": grad_norm,
                       "lr": self.scheduler.get_last_lr()[0]}
                self._log(row)
                now = time.perf_counter()
                # timings stay out of the log line (runs are compared by it); TensorBoard gets them
                timing = {"tokens_per_s": tokens / max(now - self._tick[0], 1e-9), "step_s": seconds,
                          "padding_share": 1 - stats.tokens / stats.padded_tokens}
                self._board(step).add(step, {**row, **timing}, skip=("step",))
                self._tick = (now, 0)
            if cfg.eval_every and step % cfg.eval_every == 0:
                self._validate(step)
            if m["usr2"] > 0:
                self.save_checkpoint(step)
                saved_at = step
                self._usr2 = False
                if cfg.on_usr2 == "exit":
                    self._log({"preempted_at_step": step, "exit_code": PREEMPT_EXIT_CODE})
                    return PREEMPT_EXIT_CODE
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and saved_at != step:
                self.save_checkpoint(step)
                saved_at = step
            if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps and step < self.total_steps:
                if saved_at != step:
                    self.save_checkpoint(step)
                self._log({"stopped_after_step": step})
                return 0
        step = self.sampler.global_step()
        if saved_at != step:
            self.save_checkpoint(step)
        faults.hold("train-final")  # (fault tests: every step checkpointed, final/ not yet written)
        if cfg.val_file:
            self._validate(step)
        self.save_final()
        return 0

    def _train_step(self, step: int, micro: list[list[int]]) -> tuple[torch.Tensor, float]:
        n_rows = sum(len(mb) for mb in micro)
        if self.world_size > 1:
            owner = assign_micro_batches([len(mb) * max(self.lengths[i] for i in mb) for mb in micro],
                                         self.world_size)
        else:
            owner = [0] * len(micro)
        batches: list[Batch] = []
        for mb, rank in zip(micro, owner, strict=True):
            rows = [(i, self.rows[i]) for i in mb]
            if rank == self.rank:
                batches.append(self.collator.collate(rows))
            else:
                self.collator.skip(rows)
        # DDP divides the all-reduced sum by world_size; this factor makes the result the
        # one-process mean over the step's rows.
        scale = self.world_size / n_rows
        self.model.train()
        sums = torch.zeros(len(_METRICS), dtype=torch.float64)
        # the loss terms add up on the device and are read once per step: a read per micro-batch
        # made the host wait for the GPU before launching the next micro-batch's kernels
        on_device = torch.zeros(len(_SUMMED), dtype=torch.float64, device=self.device)
        if not batches:
            self.ddp(None)["zero"].backward()
        # over the backward too: checkpointing recomputes there, with the forward's kernels
        chains = fused_kernels(on=self.model.chain_kernel == "compiled" and self.device.type == "cuda", dynamic=True)
        for j, batch in enumerate(batches):
            last = j == len(batches) - 1
            sync = contextlib.nullcontext() if last or self.world_size == 1 else self.ddp.no_sync()
            # precomputed frozen-KL targets, built on the host for this batch's rows
            frozen = self._frozen_logits(batch) if self.frozen_targets is not None else None
            lengths = [len(ids) for ids in batch.token_ids]  # the attention mask's ones, read on the host
            if self.graphs is not None:
                with varying_shape_sdpa(), chains:
                    on_device += self.graphs.run(batch, frozen, scale)
                length, _ = self.graphs.bucket(batch)
                # pad rows count as rows in the loss's row metric; they are no training rows
                sums[_METRICS.index("rows")] -= self.cfg.micro_batch_size - len(lengths)
                sums[_METRICS.index("padded_tokens")] += self.cfg.micro_batch_size * length
            else:
                batch = batch.to(self.device)
                if frozen is not None:
                    frozen = frozen.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" \
                        else frozen
                with sync, varying_shape_sdpa(), chains:
                    on_device += self._micro_batch(batch, frozen, scale)
                sums[_METRICS.index("padded_tokens")] += batch.padded_tokens
            sums[_METRICS.index("tokens")] += sum(lengths)
            sums[_METRICS.index("attended_pairs")] += sum(n * (n + 1) // 2 for n in lengths)
        if self.cfg.trace_dir:
            self._trace(step, batches)
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params]))
        self.optimizer.step()
        self.scheduler.step()
        # graphs add into .grad at the addresses they were captured with: zeroed, never replaced
        self.optimizer.zero_grad(set_to_none=self.graphs is None)
        # the step's one read of the device, after the optimizer's kernels are queued
        *summed, grad_norm = torch.cat([on_device, norm.detach().double().reshape(1)]).tolist()
        for k, v in zip(_SUMMED, summed, strict=True):
            sums[_METRICS.index(k)] += v
        return sums, grad_norm

    def _micro_batch(self, batch: Batch, frozen_targets: torch.Tensor | None,
                     scale: float | torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch on the device (the graphs capture this);
        its loss sums as one float64 vector, in ``_SUMMED`` order."""
        out = self.ddp(batch)
        loss, metrics = self._loss(batch, out, frozen_targets)
        (loss * scale).backward()
        return torch.stack([loss.detach().double()] + [metrics[k].double() for k in _SUMMED[1:]])

    def _loss(self, batch: Batch, out: dict[str, torch.Tensor | None],
              frozen_targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        frozen = out["frozen_logits"]
        if frozen is not None:
            frozen = to_canonical(frozen, batch.perm)
        else:
            frozen = frozen_targets  # precomputed, already canonical (or None)
        return decider_loss(
            to_canonical(out["logits"], batch.perm), batch.option_mask, batch.label, batch.is_score, batch.weight,
            batch.teacher, batch.has_teacher, frozen,
            score_eps=cfg.score_smoothing, kl_teacher_weight=cfg.kl_teacher_weight,
            kl_frozen_weight=cfg.kl_frozen_weight, kl_direction=cfg.kl_direction)

    def _trace(self, step: int, batches: list[Batch]) -> None:
        """Debug record: rows' token ids per rank, and (rank 0) the all-reduced gradient."""
        trace = Path(self.cfg.trace_dir)
        tokens = {str(i): ids for b in batches for i, ids in zip(b.row_index, b.token_ids, strict=True)}
        write_json_atomic(trace / f"tokens_step{step:04d}_rank{self.rank}.json", tokens)
        if self.is_main:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().cpu()
                              for p in self.params])
            with atomic_write(trace / f"grads_step{step:04d}.pt", "wb") as f:
                torch.save(flat, f)

    @torch.no_grad()
    def _validate(self, step: int) -> dict[str, float] | None:
        if not self.is_main or not self.val_rows:
            return None
        collator = Collator(self.tokenizer, max_length=self.cfg.max_length, force_bos=self.cfg.force_bos, seed=0,
                            shuffle=False)
        self.model.eval()
        nll = correct = 0.0
        size = self.cfg.val_batch_size
        for start in range(0, len(self.val_rows), size):
            rows = list(enumerate(self.val_rows[start: start + size], start))
            batch = collator.collate(rows).to(self.device)
            hidden = self.model._hidden(batch)
            r = torch.arange(hidden.shape[0], device=hidden.device)
            logits = self.model.head(hidden[r, batch.answer_pos].float(), hidden[r[:, None], batch.option_pos].float())
            logp = masked_log_softmax(logits, batch.option_mask)
            nll -= float(logp[r, batch.label].sum())
            pred = logits.masked_fill(~batch.option_mask, float("-inf")).argmax(-1)
            correct += float((pred == batch.label).sum())
        self.model.train()
        n = len(self.val_rows)
        result = {"val_step": step, "val_nll": nll / n, "val_acc": correct / n, "val_rows": n}
        self._log(result)
        return result

    # --- checkpoints ---------------------------------------------------------------------------
    def _checkpoint_config(self) -> dict[str, Any]:
        return config_to_dict(self.cfg)

    def save_checkpoint(self, step: int) -> None:
        """Every rank contributes its RNG state; rank 0 writes ``checkpoints/step_XXXXXXXX``."""
        mine = rng.capture(cuda="current")
        rngs = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(rngs, mine)
        else:
            rngs = [mine]
        if self.is_main:
            faults.hold(f"train-checkpoint-{step}")  # (fault tests: step done, its checkpoint not yet written)
            state = {"step": step, "world_size": self.world_size, "sampler": self.sampler.state_dict(),
                     "collator": self.collator.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "rng": rngs}
            path = step_dir(self.checkpoint_root, step)
            save_checkpoint(path, config=self._checkpoint_config(), adapter=self.model.adapter_state(),
                            head=self.model.head_state(), trainer_state=state)
            prune_checkpoints(self.checkpoint_root, self.cfg.keep_checkpoints)
            self._log({"checkpoint": str(path), "step": step})
        if self.world_size > 1:
            dist.barrier()  # nobody exits (USR2) before rank 0 has renamed the checkpoint into place

    def save_final(self) -> None:
        if self.is_main:
            path = self.output_dir / "final"
            save_checkpoint(path, config=self._checkpoint_config(), adapter=self.model.adapter_state(),
                            head=self.model.head_state())
            self._log({"final": str(path)})
        if self.world_size > 1:
            dist.barrier()

    # --- logging and cleanup ---------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if self.is_main:
            # one write: other ranks write to the same job log, and print() writes the newline
            # apart (unbuffered), so another rank's line could land between them
            sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
            sys.stdout.flush()

    def _board(self, step: int) -> TensorBoardLog:
        """``<output_dir>/tb`` (rank 0 writes; the others' writer writes nothing). Opened at the
        first logged step of this process, purging what an interrupted one wrote from there on."""
        if self._tb is None:
            self._tb = TensorBoardLog(self.output_dir / "tb", purge_step=step) if self.is_main else TensorBoardLog.off()
        return self._tb

    def cleanup(self) -> None:
        self._contexts.close()
        if self._tb is not None:
            self._tb.close()
        if self._old_handler is not None:
            signal.signal(signal.SIGUSR2, self._old_handler)
        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()


def recipe_main(cfg: TrainConfig) -> int:
    """Construct, set up, train, clean up; the exit code (0, or PREEMPT_EXIT_CODE after USR2)."""
    recipe = DeciderTrainRecipe(cfg)
    try:
        recipe.setup()
        return recipe.train()
    finally:
        recipe.cleanup()


def _rank_main(rank: int, world_size: int, store_dir: str, config_path: str, overrides: list[str],
               environ: dict[str, str]) -> None:
    import faulthandler
    from datetime import timedelta

    from hobson.decider.config import load_train_config

    # SIGUSR1 writes every thread's stack to stacks.<rank> (run_local_ranks asks when it times out)
    stacks = open(os.path.join(store_dir, f"stacks.{rank}"), "w")  # open as long as the rank lives
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # a forkserver child starts with the forkserver's environment; a rank sees the caller's, as under torchrun
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    # A file store, not a TCP port: a port picked free and released before rank 0 binds it can be
    # taken in between (or by a rank's own connect), which hangs the rendezvous.
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
    try:
        rc = recipe_main(load_train_config(config_path, overrides))
    finally:
        dist.destroy_process_group()
    if rc:
        sys.exit(rc)


def run_local_ranks(config_path: str, overrides: list[str], world_size: int, timeout_s: float | None = None,
                    give_up: Callable[[], bool] | None = None) -> None:
    """Run the recipe on ``world_size`` CPU ranks of this machine (gloo), like torchrun would.

    Ranks are forked from a forkserver that has already imported torch, transformers and peft, so
    each rank is a fresh process that starts in well under a second. Raises if any rank fails, or
    (``timeout_s``) if the ranks have not all ended by then: the error holds each rank's stacks, and
    no rank outlives the call. ``give_up()``, polled every second, times out at once when true (a
    test's way to make the timeout land at a known point).
    """
    import tempfile

    import torch.multiprocessing as mp

    # the forkserver is a fresh interpreter: it imports hobson.decider.train from the install
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "peft", "hobson.decider.train"])
    with tempfile.TemporaryDirectory(prefix="hobson-ranks-") as store_dir:
        args = (world_size, store_dir, str(config_path), list(overrides), dict(os.environ))
        procs = mp.start_processes(_rank_main, args=args, nprocs=world_size, start_method="forkserver", join=False)
        t0 = time.monotonic()
        try:
            while not procs.join(timeout=1.0):
                late = timeout_s is not None and time.monotonic() - t0 >= timeout_s
                if late or (give_up is not None and give_up()):
                    raise TimeoutError(f"{world_size} local ranks still running after {time.monotonic() - t0:.0f} s;"
                                       f" their stacks:\n{_rank_stacks(procs.processes, store_dir)}")
        finally:
            for proc in procs.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()


def _rank_stacks(processes: list, store_dir: str) -> str:
    for proc in processes:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)  # faulthandler writes from a signal handler: give it a moment
    return "\n".join(f"--- rank {r} ---\n" + Path(store_dir, f"stacks.{r}").read_text()
                     for r in range(len(processes)) if Path(store_dir, f"stacks.{r}").exists())


__all__ = ["DeciderTrainRecipe", "PREEMPT_EXIT_CODE", "StepStats", "recipe_main", "read_teacher", "read_training_rows",
           "run_local_ranks", "lr_lambda"]
