"""Rollout engines behind one interface, and the native torch engine.

An engine generates completions for token prompts with one seed per request and loads policy
publications (:mod:`hobson.rl.publication`)::

    engine.load_publication("runs/x/publications/v000002")   # pauses generation, verifies, commits
    outs = engine.generate(prompts, seeds, temperature=0.8, max_new_tokens=48)
    outs[i].tokens, outs[i].logprobs, outs[i].trace, outs[i].version, outs[i].digest

Reproducibility: request ``i`` samples from its own CPU ``torch.Generator`` seeded with
``seeds[i]`` (the loop derives it from (seed, update, prompt, completion), :func:`request_seed`),
so a completion depends only on its seed, its prompt and the weights, never on the batch order.
For Huginn the same seed picks the latent initial states (``like-init-cpu-f32-v1``), recorded in
the completion's trace so training replays them.

The native engine is batched: prompts are left-padded with per-row positions (so a row sees the
positions training will give it), prefilled once into the provider's KV cache (one stream per
Huginn recurrence step × core layer, one per Nanbeige loop × layer), then decoded one token per
step. Behaviour log-probs are ``log_softmax(logits / T)`` of the sampled token.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hobson.errors import ConfigError
from hobson.models.common import DTYPE_NAMES
from hobson.models.huginn import LATENT_PROFILE, HuginnConfig
from hobson.rl import publication
from hobson.rl.objectives import token_logprobs


@dataclass
class Completion:
    tokens: list[int]  # sampled tokens, the end-of-text token included when it was sampled
    logprobs: list[float]  # behaviour log-prob of each sampled token
    version: int  # publication version sampled under
    digest: str  # its digest
    trace: dict[str, Any] | None  # Huginn latent trace; None for models without latent state
    node: str | None = None  # the node a remote engine generated it on ($SLURMD_NODENAME); None in-process


class RolloutEngine(Protocol):
    version: int | None
    digest: str | None

    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, max_new_tokens: int
    ) -> list[Completion]: ...

    def load_publication(self, pub_dir: str | os.PathLike) -> publication.Manifest: ...

    def close(self) -> None: ...


def request_seed(seed: int, update: int, prompt_index: int, completion_index: int) -> int:
    """The seed of one rollout request: SHA-256 of the four numbers, 63 bits."""
    digest = hashlib.sha256(f"rollout:{seed}:{update}:{prompt_index}:{completion_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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
                want = DTYPE_NAMES[self.dtype]
                if manifest.dtype != want:
                    raise ConfigError(
                        f"{pub_dir}: published in {manifest.dtype}, this engine runs {want}; rollout and "
                        "training precision must match"
                    )
                if manifest.model_revision != self.model_revision:
                    raise ConfigError(
                        f"{pub_dir}: model revision {manifest.model_revision!r}, the engine serves "
                        f"{self.model_revision!r}"
                    )
                # the digest of the bytes read, before the provider sees them (a flipped byte is a
                # digest mismatch, not whatever model check it happens to trip)
                publication.verify(pub_dir)
                model = self.provider.load(pub_dir, dtype=self.dtype, device=self.device)
                # and of exactly the tensors now in the model (nothing changed between the reads)
                digest = publication.tensors_digest(self.provider._export_tensors(model))
                if digest != manifest.digest:
                    raise publication.DigestMismatch(
                        f"{pub_dir}: digest of the loaded tensors is {digest}, manifest says {manifest.digest}; "
                        f"refusing version {manifest.version}"
                    )
                model.eval()
                self.model, self.version, self.digest = model, manifest.version, digest  # the commit
                return manifest
            finally:
                self.paused = False

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
            B = len(prompts)
            lens = torch.tensor([len(p) for p in prompts])
            P = int(lens.max())
            dev = self.device
            ids = torch.full((B, P), self.pad_id, dtype=torch.long)
            attn = torch.zeros(B, P, dtype=torch.long)
            for b, p in enumerate(prompts):
                ids[b, P - len(p) :] = torch.tensor(p)
                attn[b, P - len(p) :] = 1
            # left padding, but each row's first real token sits at position 0, as in training
            pos = (torch.arange(P)[None, :] - (P - lens)[:, None]).clamp(min=0)
            kw = forward_kwargs(model, seeds)
            cache = model.new_cache()
            logits = model.prefill(ids.to(dev), cache, attention_mask=attn.to(dev), position_ids=pos.to(dev), **kw)[
                :, -1
            ]
            gens = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
            tokens: list[list[int]] = [[] for _ in range(B)]
            lps: list[list[float]] = [[] for _ in range(B)]
            done = [False] * B
            next_pos = lens.clone()
            for step in range(max_new_tokens):
                step_tokens = self._sample(logits.float().cpu(), temperature, gens, done)
                lp = token_logprobs(logits.float().cpu()[:, None], step_tokens[:, None], temperature or 1.0)[:, 0]
                for b in range(B):
                    if not done[b]:
                        tokens[b].append(int(step_tokens[b]))
                        lps[b].append(float(lp[b]))
                        done[b] = int(step_tokens[b]) == self.eos_id
                if all(done) or step == max_new_tokens - 1:
                    break
                live = torch.tensor([0 if d else 1 for d in done], dtype=torch.long)
                feed = torch.where(live.bool(), step_tokens, torch.full_like(step_tokens, self.pad_id))
                logits = model.decode_step(
                    feed.to(dev),
                    cache,
                    attention_mask=live[:, None].to(dev),
                    position_ids=next_pos[:, None].to(dev),
                    **kw,
                )
                next_pos += 1
            return [
                Completion(
                    tokens=tokens[b],
                    logprobs=lps[b],
                    version=self.version,
                    digest=self.digest,
                    trace=latent_trace(model, int(seeds[b]), len(tokens[b]), self.model_revision, self.version),
                )
                for b in range(B)
            ]

    @staticmethod
    def _sample(logits: Tensor, temperature: float, gens: list[torch.Generator], done: list[bool]) -> Tensor:
        """One token per row ``(B,)`` from ``logits`` ``(B, V)``; each row draws from its own generator."""
        if temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        out = torch.zeros(logits.shape[0], dtype=torch.long)
        for b, g in enumerate(gens):
            if not done[b]:
                out[b] = torch.multinomial(probs[b], 1, generator=g)[0]
        return out

    def close(self) -> None:
        self.model = None
