"""Nanbeige4.2-3B (``model_type: nanbeige``): a looped Llama-style decoder in plain torch.

Names are the official checkpoint's (``model.embed_tokens``, ``model.layers.{i}.{input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}``, ``model.norm``,
untied ``lm_head``), checked against ``tests/fixtures/official-models/nanbeige4.2-3b.params.tsv``.

Looping (from the public ``modeling_nanbeige.py``): the whole stack of ``L`` layers runs
``num_loops`` times with the same weights and the same positions; every loop has its own attention
history (KV-cache slot ``layer_idx + loop_idx * L``); ``model.norm`` is applied after every loop
(after the last one only when ``skip_loop_final_norm``). ``head_dim`` is read from the config
(Nanbeige's 128 ≠ hidden/heads = 64). GQA; RoPE rotate-half with ``rope_theta``, cos/sin in fp32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hobson.errors import ConfigError
from hobson.models import decode_attention
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
    decode_streams,
    finish_step,
    fused,
    generator_normal_,
    linear,
    prepare_attention,
    silu_mul,
)

MODEL_TYPE = "nanbeige"


@dataclass(frozen=True)
class NanbeigeConfig:
    """The config.json fields the architecture reads (names as in the official file)."""

    hidden_size: int = 3072
    intermediate_size: int = 10752
    num_hidden_layers: int = 22
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 166144
    rope_theta: float = 70_000_000.0
    rms_norm_eps: float = 1e-5
    num_loops: int = 2
    skip_loop_final_norm: bool = False
    initializer_range: float = 0.02
    # vllm-rlt builds nn.Embedding(vocab, hidden, pad_token_id): that row never gets a gradient
    pad_token_id: int | None = 0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even for RoPE")
        if self.num_loops < 1:
            problems.append(f"num_loops {self.num_loops} must be >= 1")
        unsupported = {
            "tie_word_embeddings": (False, "the checkpoint has a separate lm_head"),
            "attention_bias": (False, "no bias tensors exist"),
            "mlp_bias": (False, "no bias tensors exist"),
            "qk_layernorm": (False, "no q/k norm tensors exist"),
            "rope_scaling": (None, "plain RoPE only"),
            "hidden_act": ("silu", "SwiGLU only"),
            "loop_loss_weights": ([], "use num_loops"),
            "enable_double_loop_split": (False, "not implemented"),
            "loop_share_kv": (False, "each loop keeps its own KV"),
            "enable_hyper_connection": (False, "not implemented"),
            "enable_mhc": (False, "not implemented"),
            "enable_depth_attention": (False, "not implemented"),
            "emb_neighbor_num": (None, "n-gram embeddings not implemented"),
        }
        for key, (ok, why) in unsupported.items():
            if key in self.raw and self.raw[key] != ok:
                problems.append(f"{key}={self.raw[key]!r} is not supported ({why}); expected {ok!r}")
        if problems:
            raise ConfigError("nanbeige config: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NanbeigeConfig:
        """Read a config.json dict; keys starting with ``_`` (annotations) are ignored."""
        raw = {k: v for k, v in d.items() if not k.startswith("_")}
        if raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        kwargs = {f: raw[f] for f in cls.__dataclass_fields__ if f in raw and f != "raw"}
        if kwargs.get("head_dim") is None:
            # the class default: hidden_size // num_attention_heads (Nanbeige4.2-3B sets 128 explicitly)
            hidden = kwargs.get("hidden_size", cls.hidden_size)
            kwargs["head_dim"] = hidden // kwargs.get("num_attention_heads", cls.num_attention_heads)
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", cls.num_attention_heads)
        return cls(**kwargs, raw={"model_type": MODEL_TYPE, **raw})

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.raw)
        for k, v in asdict(self).items():
            if k != "raw" and d.get(k) != v:
                d[k] = v
        d["model_type"] = MODEL_TYPE
        d.setdefault("tie_word_embeddings", False)
        return d


def tiny_config(**overrides: Any) -> NanbeigeConfig:
    """A Nanbeige-shaped model for CPU tests: hidden 64, 4 heads × head_dim 32 (≠ 64/4), 2 KV heads."""
    d: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        rope_theta=70_000_000.0,
        rms_norm_eps=1e-5,
        num_loops=2,
        skip_loop_final_norm=False,
        tie_word_embeddings=False,
    )
    d.update(overrides)
    return NanbeigeConfig.from_dict(d)


_INV_FREQ: dict[tuple[int, float, torch.device], Tensor] = {}


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    # computed on the CPU (the reference's numbers) and moved once per device: a copy in every
    # forward would be a host sync, which CUDA-graph capture of a decode step forbids
    key = (head_dim, float(theta), device)
    if key not in _INV_FREQ:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        _INV_FREQ[key] = inv.to(device)
    return _INV_FREQ[key]


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """fp32 ``cos, sin`` ``(B, T, head_dim)`` for rotate-half RoPE; computed per call, so no buffer
    can be cast to fp16 by ``.half()``."""
    freqs = positions.float()[..., None] * _inv_freq(head_dim, theta, positions.device)  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@fused
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` ``(B, H, T, D)``; ``cos``/``sin`` ``(B, T, D)`` cast to ``x``'s dtype (as the reference does)."""
    cos = cos.to(x.dtype)[:, None]
    sin = sin.to(x.dtype)[:, None]
    return x * cos + _rotate_half(x) * sin


@fused
def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`apply_rope` of ``q`` and of ``k``: one compiled kernel for both in a decode step."""
    return apply_rope.__wrapped__(q, cos, sin), apply_rope.__wrapped__(k, cos, sin)


def _fuse_weights(*linears: nn.Linear) -> Tensor:
    """The linears' weights stacked into one matrix, each weight becoming a view of its rows.

    For decoding: at batch 16 a projection is a skinny GEMM that reads its weight at well under
    the memory bandwidth (the split-K kernels of a Nanbeige step ran at about half of it), and one
    GEMM over the stacked rows replaces three (q, k, v) or two (gate, up). The views keep the
    parameters, their names and the state dict as they were, with no second copy of the weights.
    """
    with torch.no_grad():
        stacked = torch.cat([lin.weight for lin in linears])
        for lin, rows in zip(linears, stacked.split([lin.out_features for lin in linears]), strict=True):
            lin.weight.data = rows
    return stacked


class Attention(nn.Module):
    def __init__(self, cfg: NanbeigeConfig) -> None:
        super().__init__()
        self.n_head = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)
        self.qkv_weight: Tensor | None = None  # set by fuse_projections()

    def fuse_projections(self, on: bool = True) -> None:
        self.qkv_weight = _fuse_weights(self.q_proj, self.k_proj, self.v_proj) if on else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None, slot: int
    ) -> Tensor:
        B, T, _ = x.shape
        if self.qkv_weight is not None:
            sizes = (self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
            q, k, v = linear(x, self.qkv_weight).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        streams = decode_streams(cache, slot, q)
        if streams is not None:  # the engine's decode step: RoPE, cache write and attention in one kernel
            y = decode_attention.attend(q, k, v, *streams, cache.key_mask, cache._new, rope=(cos, sin))
        else:
            q, k = rope_qk(q, k, cos, sin)
            y = cache_attend(cache, slot, q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: NanbeigeConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: Tensor | None = None  # set by fuse_projections()

    def fuse_projections(self, on: bool = True) -> None:
        self.gate_up_weight = _fuse_weights(self.gate_proj, self.up_proj) if on else None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: NanbeigeConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None, slot: int
    ) -> Tensor:
        x, m = self.deferred(x, None, cos, sin, mask, cache, slot)
        return x + m

    def deferred(
        self, x: Tensor, pending: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor | None,
        cache: KVCache | None, slot: int,
    ) -> tuple[Tensor, Tensor]:
        """The layer with its residual adds moved: ``x + pending`` is its input (``pending``, the
        last layer's MLP output, is added here, in one kernel with this layer's norm when fused),
        and it returns ``(x, mlp)`` with the MLP's add left to the next norm. Eager, the same
        additions in the same order as :meth:`forward`: the same bits."""
        norm = self.input_layernorm
        if pending is None:
            h = norm(x)
        else:
            x, h = add_rms_norm(x, pending, norm.weight, norm.eps)
        h = self.self_attn(h, cos, sin, mask, cache, slot)
        norm = self.post_attention_layernorm
        x, h = add_rms_norm(x, h, norm.weight, norm.eps)  # x + h, and its norm
        return x, self.mlp(h)


class NanbeigeLooped(CachedDecoding, nn.Module):
    """Actor (untied ``lm_head``) or critic (``value_head`` Linear(hidden, 1) instead).

    ``forward`` returns fp32 logits ``(B, T, V)`` for the actor, fp32 values ``(B, T)`` for the critic.
    """

    def __init__(self, cfg: NanbeigeConfig, critic: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.critic = critic
        self.gradient_checkpointing = False
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if critic:
            self.value_head = Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic random init: N(0, initializer_range²) for matrices, ones for norms."""
        specs = []
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                with torch.no_grad():
                    p.fill_(1.0)
            else:
                specs.append((p, self.config.initializer_range))
        generator_normal_(specs, seed)

    def new_cache(
        self, batch: int | None = None, capacity: int | None = None, device: str | torch.device | None = None
    ) -> KVCache | StaticKVCache:
        """A growing cache, or with ``capacity`` a fixed one (device-side indices, CUDA-graph safe)."""
        if capacity is None:
            return KVCache()
        return StaticKVCache(batch, capacity, device if device is not None else self.lm_head_device())

    def fuse_projections(self, on: bool = True) -> None:
        """Run q/k/v and gate/up as one GEMM each (an inference engine's choice; outputs agree with
        the separate projections up to the GEMMs' summation order). ``on=False`` goes back to the
        separate GEMMs (the weights stay views of the stacked matrices)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections(on)
            layer.mlp.fuse_projections(on)

    def lm_head_device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: Tensor,
        *,
        cache: KVCache | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` (actor) or values ``(B, T)`` (critic), fp32.

        ``cache``: append to this KV cache (``num_loops × L`` streams). ``attention_mask`` ``(B, T)``
        marks real tokens; ``position_ids`` ``(B, T)`` overrides positions (default: cache length +
        arange(T)); every loop uses the same positions.
        """
        cfg = self.config
        B, T = input_ids.shape
        if cache is not None:
            cache.check_meta(num_loops=cfg.num_loops)
        positions, mask, key_mask = prepare_attention(cache, attention_mask, B, T, input_ids.device, position_ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        x = self.model.embed_tokens(input_ids)
        L = cfg.num_hidden_layers
        # checkpointed training keeps one tensor per layer boundary; otherwise each layer's last
        # residual add waits for the next norm, which does it in its own kernel when fused
        ckpt = self.gradient_checkpointing and cache is None and torch.is_grad_enabled()
        pending: Tensor | None = None
        for loop in range(cfg.num_loops):
            for i, layer in enumerate(self.model.layers):
                slot = i + loop * L
                if ckpt:
                    x = checkpointed(layer, x, cos, sin, mask, None, slot)
                else:
                    x, pending = layer.deferred(x, pending, cos, sin, mask, cache, slot)
            if loop == cfg.num_loops - 1 or not cfg.skip_loop_final_norm:
                # the loop's final norm stays a call of its module (its hooks see every readout,
                # as the fidelity tests count): the pending add runs on its own, one kernel per loop
                if pending is not None:
                    x, pending = x + pending, None
                x = self.model.norm(x)
        finish_step(cache, T, key_mask)
        if self.critic:
            return self.value_head(x).squeeze(-1).float()
        return self.lm_head(x).float()
