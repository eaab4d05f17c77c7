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
        keep_decode: bool = True,
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
        # the last generate's decode (KV cache, step buffers, captured graph), kept so that the
        # next generate of the same shape reuses it: a capture costs ~1 ms of every Nanbeige
        # decode step at 48 tokens. release() frees it (a trainer on the same GPU needs the memory)
        self.keep_decode = keep_decode
        self._decode: _Decode | None = None

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
        each instead of three and two); the parameters keep their values, as views. While a
        decode is kept (``keep_decode``) and ``model`` has the served model's tensors by name,
        shape and dtype, its values are copied into the served model instead: the kept graph
        reads those tensors' memory, so the next generate replays it with the new weights.
        """
        model.eval()
        if model is self.model:  # already served (a bench's shortcut): only the version changes
            self.version, self.digest = version, digest
            return
        if self._decode is not None and self.model is not None and _copy_into(model, self.model):
            self.version, self.digest = version, digest
            return
        self._decode = None
        if self.device.type == "cuda" and hasattr(model, "fuse_projections"):
            model.fuse_projections()
        self.model, self.version, self.digest = model, version, digest

    def release(self) -> None:
        """Free the kept decode (its KV cache and graph); the next generate allocates and captures again."""
        with self._lock:
            self._decode = None

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
        step would. With ``keep_decode`` the cache, buffers and graph stay for the next generate
        of the same shape (:class:`_Decode`), which then captures nothing.
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
        key = (B, P + max_new, max_new, float(temperature), _addresses(model))
        run = self._decode if self._decode is not None and self._decode.key == key else None
        if run is None:
            self._decode = None  # one kept shape at a time: its cache goes before the next is made
            run = _Decode(self, model, key, B, P + max_new, max_new, temperature)
        run.start(seeds, lens, self._decode_latents(model, seeds, lens, max_new))
        kw = forward_kwargs(model, seeds)
        logits = model.prefill(ids.to(dev), run.cache, attention_mask=attn.to(dev), position_ids=pos.to(dev), **kw)
        run.record(logits[:, -1])
        graphs = run.static and dev.type == "cuda" and self.cuda_graphs
        if graphs and run.graph is None and self.warm_start and B in self._warm_batches and max_new > 2:
            # the first decode step is replayed too: an eager step launches every kernel from
            # Python (a Nanbeige step ~30 ms, a Huginn step ~130 ms, against ~6 and ~40 replayed);
            # a replay draws the same noise as an eager step, so the tokens do not change
            run.graph = self._capture(run.step, run.cache, run.gens)
        sync_every = SYNC_EVERY if dev.type == "cuda" else 1
        for step in range(1, max_new):
            if step % sync_every == 0 and bool(run.done.all()):
                break
            if run.graph is not None:
                run.graph.replay()
                continue
            run.step()
            if graphs:
                self._warm_batches.add(B)
                if step + 1 < max_new:
                    run.graph = self._capture(run.step, run.cache, run.gens)
        out = run.out_tok.tolist(), run.out_lp.tolist(), run.n_valid.tolist()
        if self.keep_decode and run.static:
            self._decode = run
        return out

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
        self._decode = None
        self.model = None


def _addresses(model: nn.Module) -> tuple[int, ...]:
    """Where every tensor of ``model`` lives (parameters, buffers and plain tensor attributes such
    as stacked projections): a kept decode graph is valid only while none of them moved."""
    out = []
    for m in model.modules():
        out += [t.data_ptr() for t in m._parameters.values() if t is not None]
        out += [t.data_ptr() for t in m._buffers.values() if t is not None]
        out += [t.data_ptr() for t in vars(m).values() if isinstance(t, Tensor)]
    return tuple(out)


@torch.no_grad()
def _copy_into(src: nn.Module, dst: nn.Module) -> bool:
    """Copy ``src``'s parameters and buffers into ``dst``'s, in place; False (nothing copied) unless
    both have the same names, shapes and dtypes."""
    a = dict(src.named_parameters(remove_duplicate=False)) | dict(src.named_buffers(remove_duplicate=False))
    b = dict(dst.named_parameters(remove_duplicate=False)) | dict(dst.named_buffers(remove_duplicate=False))
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape or a[k].dtype != b[k].dtype for k in a):
        return False
    for k, t in a.items():
        b[k].copy_(t)
    return True


class _Decode:
    """One generate's decode state: the KV cache, the fixed buffers every step reads and writes (a
    captured graph reads and writes them in place), the rows' generators and the captured step.
    ``start`` re-seeds and clears them, so a kept one serves the next generate of the same shape
    exactly as a new one would."""

    def __init__(self, engine: NativeEngine, model: nn.Module, key: tuple, B: int, capacity: int, max_new: int,
                 temperature: float) -> None:
        dev = engine.device
        self.key, self.model, self.temperature = key, model, temperature
        self.eos_id, self.pad_id = engine.eos_id, engine.pad_id
        self.cache = engine._new_cache(model, B, capacity)
        self.static = isinstance(self.cache, StaticKVCache)  # only its indices live on the device (graph-safe)
        self.gens = [torch.Generator(device=dev) for _ in range(B)]
        self.out_tok = torch.zeros(B, max_new, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(B, max_new, dtype=torch.float32, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.n_valid = torch.zeros(B, dtype=torch.long, device=dev)
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)
        self.step_at = torch.zeros(1, dtype=torch.long, device=dev)  # index of the token last sampled
        self.feed = torch.zeros(B, dtype=torch.long, device=dev)
        self.live = torch.ones(B, 1, dtype=torch.long, device=dev)
        self.next_pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.kw = forward_kwargs(model, [0] * B)  # a decode step reads its latents, never the seeds
        self.latents: Tensor | None = None  # Huginn: every decode position's initial state
        self.graph: torch.cuda.CUDAGraph | None = None

    def start(self, seeds: list[int], lens: Tensor, latents: Tensor | None) -> None:
        for g, s in zip(self.gens, seeds, strict=True):
            g.manual_seed(int(s))
        for t in (self.out_tok, self.out_lp, self.done, self.n_valid, self.tok, self.step_at, self.feed):
            t.zero_()
        self.live.fill_(1)
        self.next_pos.copy_(lens[:, None])
        if latents is not None:
            if self.latents is None:
                self.latents = torch.empty_like(latents)
                self.kw["latent_state"] = torch.empty_like(latents[:, :1])
            self.latents.copy_(latents)
            self.kw["latent_state"].copy_(latents[:, :1])
        if hasattr(self.cache, "reset"):
            self.cache.reset()

    def record(self, logits: Tensor) -> None:
        self.tok.copy_(NativeEngine._sample(logits, self.temperature, self.gens))
        self.out_tok.index_copy_(1, self.step_at, self.tok[:, None])
        lp = token_logprobs(logits[:, None], self.tok[:, None], self.temperature or 1.0)
        self.out_lp.index_copy_(1, self.step_at, lp)
        self.n_valid.add_((~self.done).long())
        self.done.logical_or_(self.tok == self.eos_id)

    def step(self) -> None:
        """One decode step and its sampling, on the fixed buffers (what a graph captures)."""
        self.feed.copy_(torch.where(self.done, torch.full_like(self.tok, self.pad_id), self.tok))
        self.live.copy_((~self.done).long()[:, None])
        if self.latents is not None:
            self.kw["latent_state"].copy_(self.latents.index_select(1, self.step_at))
        logits = self.model.decode_step(self.feed, self.cache, attention_mask=self.live, position_ids=self.next_pos,
                                        **self.kw)
        self.next_pos.add_(1)
        self.step_at.add_(1)
        self.record(logits)
