"""Rollout engines behind one interface, and the native torch engine.

An engine generates completions for token prompts with one seed per request and loads policy
publications (:mod:`hobson.rollout.publication`)::

    engine.load_publication("runs/x/publications/v000002")   # pauses generation, verifies, commits
    outs = engine.generate(prompts, seeds, temperature=0.8, max_new_tokens=48)
    outs[i].tokens, outs[i].logprobs, outs[i].trace, outs[i].version, outs[i].digest

Reproducibility: request ``i`` samples from its own ``torch.Generator`` on the engine's device,
seeded with ``seeds[i]`` (the loop derives it from (seed, rollout id, sample index) as VIME does,
:func:`request_seed`), so a completion depends only on its seed, its prompt and the weights, never
on the batch order. For Huginn the same seed picks the latent initial states
(``like-init-cpu-f32-v1``), recorded in the completion's trace so training replays them.

The native engine is batched: prompts are left-padded with per-row positions (so a row sees the
positions training will give it), prefilled once into the provider's KV cache (one stream per
Huginn recurrence step × core layer, one per Nanbeige loop × layer, HF's DynamicCache for plain HF
models), then decoded one token per step. Looped models get a fixed-capacity cache whose indices
live on the device, so on CUDA every decode step after the first replays one captured CUDA graph,
sampling included. On a GPU the engine stacks a model's projections where it can (:meth:`serve`).
Behaviour log-probs are ``log_softmax(logits / T)`` of the sampled token.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hobson import graphlock
from hobson.errors import ConfigError
from hobson.models.common import DTYPE_NAMES, StaticKVCache, fused_kernels
from hobson.models.huginn import LATENT_PROFILE, HuginnConfig, initial_state, latent_check
from hobson.models.logprobs import token_logprobs
from hobson.rollout import publication


@dataclass
class Completion:
    tokens: list[int]  # sampled tokens, the end-of-text token included when it was sampled
    logprobs: list[float]  # behaviour log-prob of each sampled token
    version: int  # publication version sampled under
    digest: str  # its digest
    trace: dict[str, Any] | None  # Huginn latent trace; None for models without latent state
    node: str | None = None  # the node a remote engine generated it on ($SLURMD_NODENAME); None in-process
    server: int | None = None  # which rollout server (its index) generated it; None in-process
    pid: int | None = None  # that server's process id


class RolloutEngine(Protocol):
    version: int | None
    digest: str | None

    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, max_new_tokens: int
    ) -> list[Completion]: ...

    def load_publication(self, pub_dir: str | os.PathLike) -> publication.Manifest: ...

    def close(self) -> None: ...


SYNC_EVERY = 8  # on a GPU, decode steps between checks whether every row has finished


def request_seed(seed: int, rollout_id: int, sample_index: int) -> int:
    """The seed of one rollout request, VIME's (``vllm_rlt_utils/engine.py:NativeEngine.generate``):
    ``(seed + rollout_id * 1_000_003 + sample_index) mod 2**63``; Huginn's latents use it too."""
    return (int(seed) + int(rollout_id) * 1_000_003 + int(sample_index)) % 2**63


def is_recurrent_depth(model: nn.Module) -> bool:
    return isinstance(getattr(model, "config", None), HuginnConfig)


def forward_kwargs(model: nn.Module, seeds: list[int], with_grad_steps: int = 0) -> dict[str, Any]:
    """Provider-specific forward arguments: Huginn's latent seeds and recurrence split, else none.

    Huginn always runs ``mean_recurrence`` steps in total (the depth rollouts used); training
    moves ``with_grad_steps`` of them under autograd (truncated backprop).
    """
    if is_recurrent_depth(model):
        total = model.config.mean_recurrence
        if not 0 <= with_grad_steps <= total:
            raise ConfigError(f"backprop steps {with_grad_steps} must be in 0..mean_recurrence ({total})")
        return {
            "seed": list(seeds),
            "num_steps_no_grad": total - with_grad_steps,
            "num_steps_with_grad": with_grad_steps,
        }
    return {}


def latent_trace(
    model: nn.Module, seed: int, n_tokens: int, model_revision: str, version: int
) -> dict[str, Any] | None:
    if not is_recurrent_depth(model):
        return None
    return {
        "seed": seed,
        "profile": LATENT_PROFILE,
        "check": latent_check(),
        "depths": [model.config.mean_recurrence] * n_tokens,
        "model_revision": model_revision,
        "policy_version": version,
    }


class NativeEngine:
    """Batched generation with the providers' own models and KV caches (every provider)."""

    def __init__(
        self,
        provider: Any,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        eos_id: int,
        pad_id: int,
        model_revision: str,
        engine_revision: str,
        cuda_graphs: bool = True,
        warm_start: bool = True,
    ) -> None:
        self.provider = provider
        self.dtype = dtype
        self.device = torch.device(device)
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.model_revision = model_revision
        self.engine_revision = engine_revision
        self.model: nn.Module | None = None
        self.version: int | None = None
        self.digest: str | None = None
        # generate() holds the lock for a whole batch: load_publication() taking it is the pause
        self._lock = threading.Lock()
        self.paused = False
        self.cuda_graphs = cuda_graphs
        # batch sizes this engine has decoded eagerly once: their compiled kernels and library
        # handles exist, so a later generate can capture its decode graph before any eager step
        self.warm_start = warm_start
        self._warm_batches: set[int] = set()

    # ------------------------------------------------------------------ publications
    def load_publication(self, pub_dir: str | os.PathLike) -> publication.Manifest:
        """Pause generation, load and verify ``pub_dir``, commit it, resume generation.

        Refused (nothing committed, the previous weights keep serving): a manifest whose dtype is
        not the engine's precision, or whose model revision is not the engine's; for Huginn a
        tied embedding whose aliases differ or a RoPE table that is not the revision's (the
        provider's load checks); a digest recomputed from the loaded tensors that differs from the
        manifest's.
        """
        with self._lock:
            self.paused = True
            try:
                manifest = publication.Manifest.read(pub_dir)
                self._check_manifest(manifest, pub_dir)
                # the digest of the bytes read, before the provider sees them (a flipped byte is a
                # digest mismatch, not whatever model check it happens to trip)
                _, digest, tensors = publication.read_verified(pub_dir)
                if "tensors" in inspect.signature(self.provider.load).parameters:
                    # the model is built from exactly the tensors just hashed: one read of the files
                    model = self.provider.load(pub_dir, dtype=self.dtype, device=self.device, tensors=tensors)
                else:
                    model = self.provider.load(pub_dir, dtype=self.dtype, device=self.device)
                    # a provider that re-reads: hash what it loaded (nothing changed between the reads)
                    digest = publication.tensors_digest(self.provider._export_tensors(model))
                    if digest != manifest.digest:
                        raise publication.DigestMismatch(
                            f"{pub_dir}: digest of the loaded tensors is {digest}, manifest says "
                            f"{manifest.digest}; refusing version {manifest.version}"
                        )
                del tensors
                self.serve(model, manifest.version, digest)  # the commit
                return manifest
            finally:
                self.paused = False

    def load_staged(self, staged: publication.Staged, source: str = "the trainer's memory") -> publication.Manifest:
        """Commit a version that arrived as tensors (a weight transport, or the trainer in this
        process): no file is opened. The same refusals as :meth:`load_publication`, the digest
        recomputed from the tensors received; on a refusal the previous version keeps serving."""
        if "config" not in inspect.signature(self.provider.load).parameters:
            raise ConfigError(f"the {type(self.provider).__name__} loads from files only: use --transport shared-dir")
        manifest = staged.manifest
        where = f"{source} (version {manifest.version})"
        with self._lock:
            self.paused = True
            try:
                self._check_manifest(manifest, where)
                digest = publication.tensors_digest(staged.tensors)
                if digest != manifest.digest:
                    raise publication.DigestMismatch(
                        f"{where}: digest of the tensors received is {digest}, the trainer's is {manifest.digest}; "
                        f"refusing version {manifest.version}"
                    )
                model = self.provider.load(where, dtype=self.dtype, device=self.device, tensors=staged.tensors,
                                           config=staged.config)
                self.serve(model, manifest.version, digest)  # the commit
                return manifest
            finally:
                self.paused = False

    def _check_manifest(self, manifest: publication.Manifest, where: Any) -> None:
        want = DTYPE_NAMES[self.dtype]
        if manifest.dtype != want:
            raise ConfigError(
                f"{where}: published in {manifest.dtype}, this engine runs {want}; rollout and "
                "training precision must match"
            )
        if manifest.model_revision != self.model_revision:
            raise ConfigError(
                f"{where}: model revision {manifest.model_revision!r}, the engine serves {self.model_revision!r}"
            )

    def serve(self, model: nn.Module, version: int, digest: str) -> None:
        """Commit ``model`` (already verified as ``version``/``digest``) as the one generating.

        On a GPU, a model that can stack its projections does (q/k/v, gate/up: one skinny GEMM
        each instead of three and two); the parameters keep their values, as views.
        """
        model.eval()
        if self.device.type == "cuda" and hasattr(model, "fuse_projections"):
            model.fuse_projections()
        self.model, self.version, self.digest = model, version, digest

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, max_new_tokens: int
    ) -> list[Completion]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        with self._lock:
            model = self.model
            if model is None or self.version is None or self.digest is None:
                raise publication.PublicationError("no publication loaded: call load_publication() first")
            if any(not p for p in prompts):
                raise ValueError("every prompt needs at least one token")
            if max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
            # the engine's GPU must be the current device: a CUDA graph records on the current
            # device's stream, and the engine may sit on another GPU than the trainer (cuda:1)
            on_gpu = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
            with fused_kernels(self.device.type == "cuda" and self.cuda_graphs), on_gpu:
                tokens, lps, n_valid = self._generate(model, prompts, seeds, temperature, max_new_tokens)
            return [
                Completion(
                    tokens=tokens[b][: n_valid[b]],
                    logprobs=lps[b][: n_valid[b]],
                    version=self.version,
                    digest=self.digest,
                    trace=latent_trace(model, int(seeds[b]), n_valid[b], self.model_revision, self.version),
                )
                for b in range(len(prompts))
            ]

    def _generate(
        self, model: nn.Module, prompts: list[list[int]], seeds: list[int], temperature: float, max_new: int
    ) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Tokens, log-probs and the number of valid tokens per row (through the first EOS).

        Everything per step stays on the device: sampling draws each row's noise from its own
        generator (on the engine's device), and the host reads the results once at the end (on a
        GPU it checks whether every row has finished only every ``SYNC_EVERY`` steps). On CUDA,
        with a model that offers a fixed-capacity cache, the first decode step runs eagerly and
        later ones replay a CUDA graph of it, sampling included: a Huginn step is ~10k small
        kernels, and a Nanbeige step's sampling (softmax, one noise draw per row's generator,
        argmax, log-prob) cost ~2 ms a step when launched one by one from Python. The row
        generators are registered with the graph, so each replay draws exactly the noise an eager
        step would.
        """
        B = len(prompts)
        dev = self.device
        lens = torch.tensor([len(p) for p in prompts])
        P = int(lens.max())
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        attn = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p)
            attn[b, P - len(p) :] = 1
        # left padding, but each row's first real token sits at position 0, as in training
        pos = (torch.arange(P)[None, :] - (P - lens)[:, None]).clamp(min=0)
        kw = forward_kwargs(model, seeds)
        cache = self._new_cache(model, B, P + max_new)
        static = isinstance(cache, StaticKVCache)  # only its indices live on the device (graph-safe)
        logits = model.prefill(ids.to(dev), cache, attention_mask=attn.to(dev), position_ids=pos.to(dev), **kw)[:, -1]

        gens = [torch.Generator(device=dev).manual_seed(int(s)) for s in seeds]
        # every per-step value lives in a fixed buffer, which a captured graph reads and writes
        out_tok = torch.zeros(B, max_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(B, max_new, dtype=torch.float32, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        n_valid = torch.zeros(B, dtype=torch.long, device=dev)
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        step_at = torch.zeros(1, dtype=torch.long, device=dev)  # index of the token last sampled
        feed = torch.zeros(B, dtype=torch.long, device=dev)
        live = torch.ones(B, 1, dtype=torch.long, device=dev)
        next_pos = lens[:, None].to(dev)
        latents = self._decode_latents(model, seeds, lens, max_new)  # Huginn: (B, max_new - 1, E)
        if latents is not None:
            kw["latent_state"] = latents[:, :1].clone()

        def record(logits: Tensor) -> None:
            tok.copy_(self._sample(logits, temperature, gens))
            out_tok.index_copy_(1, step_at, tok[:, None])
            lp = token_logprobs(logits[:, None], tok[:, None], temperature or 1.0)
            out_lp.index_copy_(1, step_at, lp)
            n_valid.add_((~done).long())
            done.logical_or_(tok == self.eos_id)

        def decode_and_record() -> None:
            feed.copy_(torch.where(done, torch.full_like(tok, self.pad_id), tok))
            live.copy_((~done).long()[:, None])
            if latents is not None:
                kw["latent_state"].copy_(latents.index_select(1, step_at))
            logits = model.decode_step(feed, cache, attention_mask=live, position_ids=next_pos, **kw)
            next_pos.add_(1)
            step_at.add_(1)
            record(logits)

        record(logits)
        graph = None
        graphs = static and dev.type == "cuda" and self.cuda_graphs
        if graphs and self.warm_start and B in self._warm_batches and max_new > 2:
            # the first decode step is replayed too: an eager step launches every kernel from
            # Python (a Nanbeige step ~30 ms, a Huginn step ~130 ms, against ~6 and ~40 replayed);
            # a replay draws the same noise as an eager step, so the tokens do not change
            graph = self._capture(decode_and_record, cache, gens)
        sync_every = SYNC_EVERY if dev.type == "cuda" else 1
        for step in range(1, max_new):
            if step % sync_every == 0 and bool(done.all()):
                break
            if graph is not None:
                graph.replay()
                continue
            decode_and_record()
            if graphs:
                self._warm_batches.add(B)
                if step + 1 < max_new:
                    graph = self._capture(decode_and_record, cache, gens)
        return out_tok.tolist(), out_lp.tolist(), n_valid.tolist()

    @staticmethod
    def _new_cache(model: nn.Module, batch: int, capacity: int) -> Any:
        if "capacity" in inspect.signature(model.new_cache).parameters:
            return model.new_cache(batch=batch, capacity=capacity)
        return model.new_cache()  # a model with only a growing cache (plain HF models)

    @staticmethod
    def _capture(step: Callable[[], None], cache: Any, gens: list[torch.Generator]) -> torch.cuda.CUDAGraph:
        """Record ``step`` (one decode step and its sampling, on fixed buffers) as a CUDA graph.

        Recording runs no kernel: the cache's host-side count, advanced while recording, is put
        back; its device-side write position advances inside every replay. Each row's generator is
        registered first, so a replay advances its Philox offset as an eager step does.
        """
        length = cache.length
        graph = torch.cuda.CUDAGraph()
        for g in gens:
            graph.register_generator_state(g)
        # thread_local: the background checkpoint writer copies GPU tensors to the host while the
        # next rollout records; in the default "global" mode any such call from another thread
        # invalidates the capture (cudaErrorStreamCaptureInvalidated, seen on two H200s)
        # and hobson.graphlock keeps the writer's own CUDA calls out of the capture altogether
        with graphlock.CAPTURE, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        cache.length = length
        return graph

    @staticmethod
    def _decode_latents(model: nn.Module, seeds: list[int], lens: Tensor, max_new: int) -> Tensor | None:
        """Huginn's initial states of every decode position, drawn up front (one copy to the device)."""
        if not is_recurrent_depth(model) or max_new < 2:
            return None
        positions = lens[:, None] + torch.arange(max_new - 1)[None, :]
        p = next(model.parameters())
        state = initial_state([int(s) for s in seeds], positions, model.config.n_embd)
        return state.to(device=p.device, dtype=p.dtype)

    @staticmethod
    def _sample(logits: Tensor, temperature: float, gens: list[torch.Generator]) -> Tensor:
        """One token per row ``(B,)`` from ``logits`` ``(B, V)``; each row draws from its own generator.

        The exponential race (``argmax p / E`` with ``E ~ Exp(1)`` per vocabulary entry) picks
        token v with probability p(v); one noise vector per row keeps a row's token independent
        of the rest of the batch, and nothing waits for the host.
        """
        if temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        noise = torch.empty_like(probs)
        for b, g in enumerate(gens):
            noise[b].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)

    def close(self) -> None:
        self.model = None
