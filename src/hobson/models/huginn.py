"""Huginn-0125 ("raven", ``model_type: huginn_raven``): a recurrent-depth transformer in plain torch.

Parameter and buffer names are the official checkpoint's (``transformer.wte``,
``transformer.prelude.{i}``, ``transformer.adapter``, ``transformer.core_block.{i}``,
``transformer.coda.{i}``, ``transformer.ln_f``, ``lm_head`` tied to ``wte``, buffer ``freqs_cis``),
checked against ``tests/fixtures/official-models/huginn-0125.params.tsv``. The layout follows the
public reference (seal-rg/recurrent-pretraining ``recpre/raven_modeling_minimal.py``):

    e = prelude(wte(ids) · sqrt(E))
    s = s0                                    # random initial state, see initial_state()
    repeat num_steps: s = core_blocks(adapter(cat([s, e])))   # as W_s·s + (W_e·e, once)
    logits = lm_head(ln_f(coda(ln_f(s))))

Sandwich block: ``x = norm_2(attn(norm_1 x) + x); x = norm_4(mlp(norm_3 x) + x)``. Attention is a
fused ``Wqkv`` (q|k|v), a learned ``qk_bias`` ``[2, 1, H, D]`` added to q and k before RoPE, and
RoPE on interleaved pairs (dims 2i, 2i+1) from the fp32 table ``freqs_cis``
``[1, block_size, 1, D/2, 2]`` (cos, sin). MLP: ``fc: E -> 2I`` split gate|up, ``silu(gate)·up``.
Training right-pads; attention is causal. Truncated backprop: ``num_steps_no_grad`` recurrence
steps run under ``torch.no_grad``, then ``num_steps_with_grad`` steps record the graph (their
gradients reach adapter, core blocks and, through the injected ``e``, the prelude).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hobson.errors import ConfigError
from hobson.models.common import (
    CachedDecoding,
    Embedding,
    KVCache,
    Linear,
    RMSNorm,
    StaticKVCache,
    add_rms_norm,
    cache_attend,
    checkpointed,
    finish_step,
    fused,
    fused_on,
    generator_normal_,
    prepare_attention,
    rms_norm,
    silu_mul,
)

MODEL_TYPE = "huginn_raven"
LATENT_PROFILE = "like-init-cpu-f32-v1"


@dataclass(frozen=True)
class HuginnConfig:
    """The config.json fields the architecture reads (names as in the official file)."""

    n_embd: int = 5280
    n_heads: int = 55
    intermediate_size: int = 17920
    vocab_size: int = 65536
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    rope_base: float = 50000.0
    block_size: int = 4096
    norm_eps: float = 1e-6
    qk_bias: bool = True
    bias: bool = False
    tie_embeddings: bool = True
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if self.n_embd % self.n_heads:
            problems.append(f"n_embd {self.n_embd} is not a multiple of n_heads {self.n_heads}")
        elif (self.n_embd // self.n_heads) % 2:
            problems.append(f"head_dim {self.n_embd // self.n_heads} must be even for RoPE pairs")
        head_dim = self.raw.get("head_dim")
        if head_dim is not None and self.n_heads and head_dim != self.n_embd // self.n_heads:
            problems.append(f"head_dim {head_dim} != n_embd // n_heads = {self.n_embd // self.n_heads}")
        kv = self.raw.get("num_key_value_heads")
        if kv is not None and kv != self.n_heads:
            problems.append(f"num_key_value_heads {kv} != n_heads {self.n_heads} (raven has no GQA)")
        if not self.tie_embeddings:
            problems.append("tie_embeddings false is not supported (the raven checkpoint ties lm_head to wte)")
        if self.raw.get("injection_type", "linear") != "linear":
            problems.append(f"injection_type {self.raw['injection_type']!r} is not supported (only 'linear')")
        if self.raw.get("state_init", "like-init") != "like-init":
            problems.append(f"state_init {self.raw['state_init']!r} is not supported (only 'like-init')")
        if self.raw.get("test_time_noise", 0):
            problems.append("test_time_noise is not supported (the latent replay assumes none)")
        if problems:
            raise ConfigError("huginn_raven config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def init_std(self) -> float:
        # "takase" init of the reference: sqrt(2 / (5 E)); also the latent state's std
        return math.sqrt(2.0 / (5.0 * self.n_embd))

    @property
    def emb_scale(self) -> float:
        return math.sqrt(self.n_embd)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HuginnConfig:
        """Read a config.json dict; keys starting with ``_`` (annotations) are ignored."""
        raw = {k: v for k, v in d.items() if not k.startswith("_")}
        if raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        vocab = raw.get("padded_vocab_size", raw.get("vocab_size"))
        if "vocab_size" in raw and vocab != raw["vocab_size"]:
            raise ConfigError(f"padded_vocab_size {vocab} != vocab_size {raw['vocab_size']}")
        kwargs: dict[str, Any] = {}
        for f in cls.__dataclass_fields__:
            if f in raw and f != "raw":
                kwargs[f] = raw[f]
        if vocab is not None:
            kwargs["vocab_size"] = vocab
        return cls(**kwargs, raw={"model_type": MODEL_TYPE, **raw})

    def to_dict(self) -> dict[str, Any]:
        """The config.json to write: the original keys, with the architecture fields as read."""
        d = dict(self.raw)
        for k, v in asdict(self).items():
            if k != "raw" and d.get(k) != v:  # keep the file's spelling (50000 vs 50000.0)
                d[k] = v
        if d.get("padded_vocab_size") != self.vocab_size:
            d["padded_vocab_size"] = self.vocab_size
        d["model_type"] = MODEL_TYPE
        return d


def tiny_config(**overrides: Any) -> HuginnConfig:
    """A Huginn-shaped model small enough for CPU tests (E 64, 4 heads of 16, vocab 256)."""
    d: dict[str, Any] = dict(
        n_embd=64,
        n_heads=4,
        intermediate_size=128,
        vocab_size=256,
        n_layers_in_prelude=1,
        n_layers_in_recurrent_block=2,
        n_layers_in_coda=1,
        mean_recurrence=4,
        mean_backprop_depth=2,
        rope_base=50000.0,
        block_size=64,
        norm_eps=1e-6,
        qk_bias=True,
        bias=False,
        tie_embeddings=True,
    )
    d.update(overrides)
    return HuginnConfig.from_dict(d)


# ---------------------------------------------------------------------------------------------
# RoPE and the latent initial state


def rope_table(head_dim: int, length: int, base: float) -> Tensor:
    """``freqs_cis`` ``[1, length, 1, head_dim/2, 2]`` fp32: (cos, sin) of ``p / base^(2i/head_dim)``."""
    # always computed on the CPU (also while a model is built under ``torch.device("meta")``): the
    # table is small, and CPU fp32 is the reference its checkpoint copy is compared against
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device="cpu"), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


@fused
def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate interleaved pairs of ``x`` ``(B, T, H, D)`` by ``freqs`` ``(B, T, 1, D/2, 2)``, in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = freqs[..., 0], freqs[..., 1]
    rotated = torch.stack(
        [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1
    )
    return rotated.flatten(-2).to(x.dtype)


@fused
def bias_rope_qk(q: Tensor, k: Tensor, bias: Tensor | None, freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``qk_bias`` added to ``q`` and ``k`` (cast to ``dtype``), then :func:`apply_rope` of each:
    one compiled kernel in a decode step instead of four (eager: the same operations as written
    before, in the same order)."""
    if bias is not None:
        q = (q + bias[0]).to(dtype)
        k = (k + bias[1]).to(dtype)
    return apply_rope.__wrapped__(q, freqs), apply_rope.__wrapped__(k, freqs)


def sandwich_norms(attn: Tensor, x: Tensor, w2: Tensor, w3: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x = norm_2(attn + x)`` and the MLP's input ``norm_3(x)``, one kernel when fused (a decode
    step's few rows: :mod:`hobson.models.rownorm`; more rows: one compiled kernel)."""
    if fused_on():
        from hobson.models import rownorm

        if rownorm.usable(attn, x, w2, w3):
            return rownorm.sandwich(attn, x, w2, w3, eps)
    return _sandwich_norms(attn, x, w2, w3, eps)


@fused
def _sandwich_norms(attn: Tensor, x: Tensor, w2: Tensor, w3: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x = rms_norm.__wrapped__(attn + x, w2, eps)
    return x, rms_norm.__wrapped__(x, w3, eps)


@functools.cache
def latent_check() -> str:
    """The first values this derivation draws for seed 0, position 0, width 16: recorded with a
    run's profile and every trace, so latents drawn under another derivation are refused by name."""
    return "seed 0, position 0, width 16: " + " ".join(f"{v:.6f}" for v in latent_vector(0, 0, 16)[:4].tolist())


def latent_profile(dtype: torch.dtype) -> dict[str, str]:
    """What a latent replay depends on, to persist beside a run and check before replaying.

    The noise is drawn on the CPU in fp32 (profile ``like-init-cpu-f32-v1``), but torch's
    truncated-normal sampler, the CPU architecture and the model dtype the state is cast to can
    all change the bits; ``check`` pins the seed derivation (:func:`latent_check`).
    """
    return {
        "profile": LATENT_PROFILE,
        "check": latent_check(),
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "machine": platform.machine(),
    }


def check_latent_profile(recorded: dict[str, str], dtype: torch.dtype) -> None:
    """Refuse to replay latents recorded under another profile, naming every difference."""
    current = latent_profile(dtype)
    diffs = [
        f"{k}: recorded {recorded.get(k)!r}, now {current[k]!r}"
        for k in sorted(current)
        if recorded.get(k) != current[k]
    ]
    if diffs:
        why = (" (no check: drawn with hobson's old SHA-256 seed derivation, not vllm-rlt's BLAKE2b one)"
               if "check" not in recorded else "")
        raise ConfigError("latent profile differs, replayed log-probs would not match: " + "; ".join(diffs) + why)


def trace_latents(trace: Mapping[str, Any], n_positions: int, n_embd: int) -> Tensor:
    """``(n_positions, E)`` fp32 CPU latents of positions ``0..n_positions-1`` of a recorded trace.

    Reads vllm-rlt's ``RecurrentTrace`` layout (``model_family``, ``latent_seed``,
    ``latent_profile``; positions are the request's logical input positions, prompt then
    response) and hobson's own (``seed``, ``profile``, ``check``). A trace of another model
    family or profile, without a latent seed, or (hobson's) drawn under another seed derivation
    is refused, naming the field.
    """
    if "latent_profile" in trace or "model_family" in trace:  # vllm-rlt / VIME
        if trace.get("model_family") != "huginn_raven":
            raise ConfigError(f"trace model_family {trace.get('model_family')!r}: latents exist for huginn_raven only")
        profile, seed = trace.get("latent_profile"), trace.get("latent_seed")
        check = latent_check()  # the profile name fixes vllm-rlt's derivation
    else:
        profile, seed, check = trace.get("profile"), trace.get("seed"), trace.get("check")
    if profile != LATENT_PROFILE:
        raise ConfigError(f"trace latent profile {profile!r}: this replay draws {LATENT_PROFILE!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ConfigError(f"trace latent seed {seed!r}: needs an integer in [0, 2**63) (a trace without one has none)")
    if check != latent_check():
        raise ConfigError(
            f"trace latent check {check!r}, now {latent_check()!r}: the trace was drawn under another seed "
            "derivation (hobson before conventions v2 hashed a string with SHA-256); it cannot be replayed here"
        )
    return torch.stack([latent_vector(seed, p, n_embd) for p in range(n_positions)])


def latent_seed(seed: int, position: int) -> int:
    """Generator seed for position ``position`` of a completion sampled with ``seed``.

    vllm-rlt's definition (``huginn_latents.py:replay_huginn_latents``), so that a trace it
    recorded replays here to the same latents: BLAKE2b (8-byte digest) of ``seed`` and
    ``position`` as 8-byte little-endian integers, read little-endian, modulo 2**63.
    """
    identity = int(seed).to_bytes(8, "little") + int(position).to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(identity, digest_size=8).digest(), "little") % 2**63


def latent_vector(seed: int, position: int, n_embd: int) -> Tensor:
    """The fp32 CPU initial state of one position (profile ``like-init-cpu-f32-v1``).

    Truncated normal, std ``σ = sqrt(2 / (5 E))``, cut at ±3σ, times ``sqrt(E)``, drawn from a
    ``torch.Generator`` seeded with :func:`latent_seed`. Depends on nothing but (seed, position, E).
    """
    std = math.sqrt(2.0 / (5.0 * n_embd))
    g = torch.Generator(device="cpu").manual_seed(latent_seed(seed, position))
    v = torch.empty(n_embd, dtype=torch.float32)
    nn.init.trunc_normal_(v, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=g)
    return v * math.sqrt(n_embd)


def latent_like(batch: int, length: int, n_embd: int, generator: torch.Generator) -> Tensor:
    """``(batch, length, E)`` fp32 states with :func:`latent_vector`'s distribution, all drawn from
    one ``generator``: noise for supervised training, where no trace replays it (rollouts and
    their training forwards use :func:`initial_state`)."""
    std = math.sqrt(2.0 / (5.0 * n_embd))
    v = torch.empty(batch, length, n_embd, dtype=torch.float32)
    nn.init.trunc_normal_(v, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
    return v * math.sqrt(n_embd)


class LatentCache:
    """The newest (seed, position, E) vectors drawn, at most ``max_bytes`` of them.

    A colocated RL update draws every vector twice, once in the rollout and once for training
    (2,816 for 16 x 176 Huginn tokens, ~0.35 s on the host with the GPU waiting): with this the
    training forwards find what the rollout drew. A vector is drawn from its own generator and
    depends on nothing else, so a cached one is bit for bit a fresh one. Callers never change the
    tensors they get (``initial_state`` stacks copies of them).
    """

    def __init__(self, max_bytes: int) -> None:
        import threading
        from collections import OrderedDict

        self.max_bytes, self.bytes, self.hits, self.misses = max_bytes, 0, 0, 0
        self._items: OrderedDict[tuple[int, int, int], Tensor] = OrderedDict()
        self._lock = threading.Lock()  # the engine and the trainer may draw from different threads

    def vector(self, seed: int, position: int, n_embd: int) -> Tensor:
        key = (seed, position, n_embd)
        with self._lock:
            v = self._items.get(key)
            if v is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return v
            self.misses += 1
        v = latent_vector(seed, position, n_embd)
        size = v.numel() * v.element_size()
        with self._lock:
            if size <= self.max_bytes and key not in self._items:
                self._items[key] = v
                self.bytes += size
                while self.bytes > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self.bytes -= old.numel() * old.element_size()
        return v

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = self.hits = self.misses = 0


_LATENT_CACHE: list[LatentCache] = []


def latent_cache() -> LatentCache:
    """The process's cache, sized by ``HOBSON_LATENT_CACHE_MB`` when first used (default 256 MiB:
    ~12,700 Huginn vectors of E = 5,280, four updates of 16 x 176 tokens; 0 turns it off)."""
    if not _LATENT_CACHE:
        raw = os.environ.get("HOBSON_LATENT_CACHE_MB", "256")
        try:
            mb = float(raw)
        except ValueError:
            mb = -1.0
        if not mb >= 0:  # also NaN
            raise ConfigError(f"HOBSON_LATENT_CACHE_MB={raw!r} is not a size in MiB >= 0: unset it for 256, "
                              "or set 0 to draw every latent vector afresh")
        _LATENT_CACHE.append(LatentCache(int(mb * 2**20)))
    return _LATENT_CACHE[0]


def initial_state(seeds: Sequence[int], positions: Tensor, n_embd: int) -> Tensor:
    """``(B, T, E)`` fp32 CPU initial states: row ``b`` at position ``positions[b, t]`` from ``seeds[b]``.

    A row's state depends only on its own seed and positions, never on the other rows. Each
    distinct (seed, position) vector is drawn once from its own generator (~150 µs each, nearly all
    of it the generator's seeding and uniform draws) or found in :func:`latent_cache`. A forward
    given the states (``latent_state``) draws none: the RL update draws them once for its forwards.
    Drawing them on a pool of threads was slower on a 16-core GPU host (1.94 s against 1.53 s per
    16 x 176 training forward, 2026-12-04): the per-vector work holds the GIL.
    """
    pos = positions.cpu().tolist()
    if len(seeds) != len(pos):
        raise ValueError(f"{len(seeds)} seeds for a batch of {len(pos)}")
    slot: dict[tuple[int, int], int] = {}
    index = [[slot.setdefault((int(s), int(p)), len(slot)) for p in row] for s, row in zip(seeds, pos, strict=True)]
    cache = latent_cache()
    vectors = [cache.vector(s, p, n_embd) for s, p in slot]
    T = len(pos[0]) if pos else 0
    if not vectors:
        return torch.empty(len(pos), T, n_embd)
    return torch.stack(vectors)[torch.tensor(index, dtype=torch.long).reshape(-1)].reshape(len(pos), T, n_embd)


# ---------------------------------------------------------------------------------------------
# Modules


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.Wqkv = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        if cfg.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, cfg.n_heads, cfg.head_dim))
        else:
            self.qk_bias = None
        self.proj = Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor, freqs: Tensor, mask: Tensor | None, cache: KVCache | None, slot: Any) -> Tensor:
        B, T, E = x.shape
        q, k, v = self.Wqkv(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)  # each (B, T, H, D)
        q, k = bias_rope_qk(q, k, self.qk_bias, freqs, x.dtype)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        y = cache_attend(cache, slot, q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, E))


class GatedMLP(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.n_embd, 2 * cfg.intermediate_size, bias=False)
        self.proj = Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(silu_mul(gate, up))


class SandwichBlock(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.norm_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = GatedMLP(cfg)
        self.norm_3 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.norm_4 = RMSNorm(cfg.n_embd, cfg.norm_eps)

    def forward(self, x: Tensor, freqs: Tensor, mask: Tensor | None, cache: KVCache | None, slot: Any) -> Tensor:
        return self.chained(x, None, None, freqs, mask, cache, slot)[0]

    def chained(
        self, x: Tensor, h: Tensor | None, next_norm: RMSNorm | None, freqs: Tensor, mask: Tensor | None,
        cache: KVCache | None, slot: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """The block, with ``h = norm_1(x)`` given when the block before computed it, and returning
        ``(out, next_norm(out))``: the next block's first norm runs in this block's last norm's kernel
        when fused (one kernel fewer per block of a chain). Eager, the same operations in the same
        order as one block after another: the same bits."""
        a = self.attn(self.norm_1(x) if h is None else h, freqs, mask, cache, slot)
        # x = norm_2(a + x); h = norm_3(x); out = norm_4(mlp(h) + x), with the adds in the norms' kernels
        x, h = sandwich_norms(a, x, self.norm_2.weight, self.norm_3.weight, self.norm_2.eps)
        m = self.mlp(h)
        if next_norm is None:
            return add_rms_norm(m, x, self.norm_4.weight, self.norm_4.eps)[1], None
        return sandwich_norms(m, x, self.norm_4.weight, next_norm.weight, self.norm_4.eps)


class HuginnRaven(CachedDecoding, nn.Module):
    """Actor (``lm_head`` tied to ``transformer.wte``) or critic (``value_head`` Linear(E, 1) instead).

    ``forward`` returns fp32 logits ``(B, T, V)`` for the actor, fp32 values ``(B, T)`` for the critic.
    """

    freqs_cis: Tensor

    def __init__(self, cfg: HuginnConfig, critic: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.critic = critic
        self.gradient_checkpointing = False
        self.transformer = nn.ModuleDict(
            dict(
                wte=Embedding(cfg.vocab_size, cfg.n_embd),
                prelude=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_prelude)),
                adapter=Linear(2 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
                core_block=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_recurrent_block)),
                coda=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_coda)),
                ln_f=RMSNorm(cfg.n_embd, cfg.norm_eps),
            )
        )
        if critic:
            self.value_head = Linear(cfg.n_embd, 1, bias=False)
        else:
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            self.tie_weights()
        self.register_buffer("freqs_cis", self.expected_freqs_cis(), persistent=True)

    def expected_freqs_cis(self) -> Tensor:
        """The RoPE table this config implies (what a checkpoint's ``freqs_cis`` must equal)."""
        cfg = self.config
        return rope_table(cfg.head_dim, cfg.block_size, cfg.rope_base)

    def tie_weights(self) -> None:
        if not self.critic:
            self.lm_head.weight = self.transformer.wte.weight

    def _apply(self, fn: Any, recurse: bool = True) -> HuginnRaven:
        # The RoPE table stays fp32 whatever the parameters become (.half(), .to(bf16)); it only
        # follows device moves. Without this, fp16 RoPE angles at long positions lose precision.
        freqs = self._buffers.pop("freqs_cis")
        try:
            super()._apply(fn, recurse)
        finally:
            moved = fn(freqs)
            if moved.dtype != torch.float32:
                moved = freqs.to(device=moved.device, dtype=torch.float32)
            self._buffers["freqs_cis"] = moved
        return self

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic random init (reference "takase": N(0, σ²), output projections σ/sqrt(2·depth))."""
        cfg = self.config
        std = cfg.init_std
        depth = cfg.n_layers_in_prelude + cfg.n_layers_in_coda + cfg.n_layers_in_recurrent_block * cfg.mean_recurrence
        out_std = std / math.sqrt(2 * depth)
        specs = []
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                specs.append((p, out_std))
            elif "norm" in name or name.endswith("ln_f.weight"):
                with torch.no_grad():
                    p.fill_(1.0)
            elif name.endswith("qk_bias") or name.endswith(".bias"):
                with torch.no_grad():
                    p.zero_()
            else:
                specs.append((p, std))
        generator_normal_(specs, seed)

    def new_cache(
        self, batch: int | None = None, capacity: int | None = None, device: str | torch.device | None = None
    ) -> KVCache | StaticKVCache:
        """A growing cache, or with ``capacity`` a fixed one (device-side indices, CUDA-graph safe)."""
        if capacity is None:
            return KVCache()
        if capacity > self.config.block_size:
            raise ValueError(f"cache capacity {capacity} is beyond block_size {self.config.block_size}")
        return StaticKVCache(batch, capacity, device if device is not None else self.freqs_cis.device)

    def _block(
        self, block: SandwichBlock, x: Tensor, freqs: Tensor, mask: Tensor | None, cache: KVCache | None, slot: Any
    ) -> Tensor:
        if self.gradient_checkpointing and cache is None and torch.is_grad_enabled():
            return checkpointed(block, x, freqs, mask, None, slot)
        return block(x, freqs, mask, cache, slot)

    def _chain(
        self, blocks: nn.ModuleList, x: Tensor, freqs: Tensor, mask: Tensor | None, cache: KVCache | None,
        slots: list[Any],
    ) -> Tensor:
        """Blocks one after another; each block's last norm also computes the next one's first
        (:meth:`SandwichBlock.chained`), except under activation checkpointing, where each block
        is its own checkpoint."""
        if self.gradient_checkpointing and cache is None and torch.is_grad_enabled():
            for block, slot in zip(blocks, slots, strict=True):
                x = self._block(block, x, freqs, mask, cache, slot)
            return x
        h = None
        for i, (block, slot) in enumerate(zip(blocks, slots, strict=True)):
            # every norm of the model has the config's one eps, which sandwich_norms applies to both
            x, h = block.chained(x, h, blocks[i + 1].norm_1 if i + 1 < len(blocks) else None,
                                 freqs, mask, cache, slot)
        return x

    def injected(self, e: Tensor) -> Tensor:
        """The adapter's product with the injected ``e`` (and its bias): ``adapter(cat([s, e]))`` is
        ``W_s·s + (W_e·e + b)``, and ``e`` is the same in every recurrence step, so this half is
        computed once per forward rather than in each of the ``mean_recurrence`` steps."""
        w = self.transformer.adapter.weight
        return nn.functional.linear(e, w[:, self.config.n_embd:], self.transformer.adapter.bias)

    def _core_step(
        self, state: Tensor, e_in: Tensor, freqs: Tensor, mask: Tensor | None, cache: KVCache | None, step: int
    ) -> Tensor:
        # adapter(cat([state, e])) as one GEMM over the state's half of the weight, whose epilogue
        # adds the injected half (:meth:`injected`): half the adapter's weight reads and FLOPs of a
        # step (a decode step reads the adapter once per recurrence, 32 times), and no cat kernel.
        # The sum is rounded once more than the concatenated product's (e_in is rounded to the
        # model's dtype first): within the engine/trainer bound, and the same in both.
        w = self.transformer.adapter.weight[:, : self.config.n_embd]
        x = torch.addmm(e_in.reshape(-1, e_in.shape[-1]), state.reshape(-1, state.shape[-1]), w.t())
        # not a view (as linear()'s own output): a view's base is one more thing torch.compile's
        # guards on the norms' inputs would tell apart, a recompile for each kind of input
        x = torch.ops.aten._unsafe_view(x, state.shape)
        blocks = self.transformer.core_block
        return self._chain(blocks, x, freqs, mask, cache, [("core", step, j) for j in range(len(blocks))])

    def forward(
        self,
        input_ids: Tensor,
        num_steps_no_grad: int | None = None,
        num_steps_with_grad: int = 0,
        *,
        seed: int | Sequence[int] = 0,
        cache: KVCache | StaticKVCache | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        latent_state: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` (actor) or values ``(B, T)`` (critic), fp32.

        ``input_ids`` ``(B, T)``. The recurrence runs ``num_steps_no_grad`` steps without a graph
        (default: ``mean_recurrence - num_steps_with_grad``), then ``num_steps_with_grad`` with one.
        ``seed``: one int, or one per row; the initial state of row b at position p is
        :func:`latent_vector` (seed[b], p). ``cache``: append to this KV cache (prefill, then one
        token per call); every call on a cache must use the same number of steps.
        ``attention_mask`` ``(B, T)`` marks real tokens (padding is never attended to);
        ``position_ids`` ``(B, T)`` overrides the positions (default: cache length + arange(T)).
        ``latent_state`` ``(B, T, E)``: the initial states, already drawn (they must be what
        :func:`initial_state` gives for these seeds and positions; the engine draws them ahead so
        a decode step reads no host data).
        """
        cfg = self.config
        if num_steps_no_grad is None:
            num_steps_no_grad = cfg.mean_recurrence - num_steps_with_grad
        if num_steps_no_grad < 0 or num_steps_with_grad < 0:
            raise ValueError(f"negative recurrence steps ({num_steps_no_grad}, {num_steps_with_grad})")
        B, T = input_ids.shape
        seeds = [int(seed)] * B if isinstance(seed, int) else [int(s) for s in seed]
        if cache is not None:
            cache.check_meta(num_steps=num_steps_no_grad + num_steps_with_grad)
        device = input_ids.device
        positions, mask, key_mask = prepare_attention(cache, attention_mask, B, T, device, position_ids)
        # The host's copy of the positions, for the block_size check and the latent draws. Without
        # position_ids they are known on the host, so a training forward never waits on the GPU;
        # a static cache bounds positions by its capacity (checked when it was made), and the
        # check would be a host sync inside every decode step.
        host_positions = None
        if T and not isinstance(cache, StaticKVCache):
            if position_ids is None:
                past = cache.length if cache is not None else 0
                host_positions = torch.arange(past, past + T).expand(B, T)
            else:
                host_positions = position_ids.cpu()
            if int(host_positions.max()) >= cfg.block_size:
                raise ValueError(f"position {int(host_positions.max())} is beyond block_size {cfg.block_size}")
        freqs = self.freqs_cis[0][positions]  # (B, T, 1, D/2, 2), fp32

        x = self.transformer.wte(input_ids) * cfg.emb_scale
        prelude, coda = self.transformer.prelude, self.transformer.coda
        x = self._chain(prelude, x, freqs, mask, cache, [("prelude", i) for i in range(len(prelude))])
        e_in = self.injected(x)
        if latent_state is None:
            latent_state = initial_state(seeds, positions if host_positions is None else host_positions, cfg.n_embd)
        state = latent_state.to(device=device, dtype=e_in.dtype)
        with torch.no_grad():
            for step in range(num_steps_no_grad):
                state = self._core_step(state, e_in, freqs, mask, cache, step)
        for step in range(num_steps_no_grad, num_steps_no_grad + num_steps_with_grad):
            state = self._core_step(state, e_in, freqs, mask, cache, step)
        x = self.transformer.ln_f(state)
        x = self._chain(coda, x, freqs, mask, cache, [("coda", i) for i in range(len(coda))])
        x = self.transformer.ln_f(x)
        finish_step(cache, T, key_mask)
        if self.critic:
            return self.value_head(x).squeeze(-1).float()
        return self.lm_head(x).float()
