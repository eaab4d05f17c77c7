"""Nanbeige as a vLLM out-of-tree model: the looped decoder with one attention layer (KV cache) per loop.

:func:`register` (idempotent; :class:`hobson.rollout.vllm_engine.VLLMEngine` calls it before building
the ``LLM``) teaches transformers' ``AutoConfig`` the ``nanbeige`` model type (a Llama config
plus ``num_loops``/``skip_loop_final_norm``, no remote code) and registers
:class:`NanbeigeForCausalLM` with vLLM's ``ModelRegistry`` as :data:`ARCHITECTURE`. The engine
selects it with ``hf_overrides={"architectures": [ARCHITECTURE]}``, so a publication's
``config.json`` stays the provider's export (official names; an ``architectures`` entry, if any,
is ignored, and vLLM's own ``NanbeigeForCausalLM`` mapping, the transformers backend with remote
code, is left alone).

The math is :mod:`hobson.models.nanbeige`'s, op for op, so vLLM's behaviour log-probs agree with the
trainer's recomputation: the ``L`` decoder layers (one set of q/k/v/o, MLP and norm weights) run
``num_loops`` times at the same positions, each loop through its own vLLM ``Attention`` layer, so
its own KV cache (the reference's slot ``layer_idx + loop_idx * L``); ``model.norm`` after every
loop (only after the last with ``skip_loop_final_norm``); residuals added in the reference's order
(``x + attn(ln(x))``, not vLLM's fused add-and-norm); ``head_dim`` from the config; rotate-half RoPE
with ``rope_theta``; untied ``lm_head``.

The per-loop attention layers are ``model.loop_attn.{slot}``: vLLM orders KV caches by the one
integer in a layer's name (``extract_layer_index``), so a name like ``loops.1.layers.0`` with two
integers is refused there.

Registration is per process: the engine keeps vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
A vLLM that starts its own worker processes (``vllm serve``, multiprocessing on) needs
:func:`register` as a ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, LlamaConfig
from vllm import ModelRegistry
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from hobson.errors import ConfigError
from hobson.models import nanbeige

ARCHITECTURE = "HobsonNanbeigeForCausalLM"


class NanbeigeHFConfig(LlamaConfig):
    """transformers' view of a Nanbeige config.json: Llama's fields (``head_dim`` read, not derived;
    ``rope_theta`` folded into ``rope_parameters``) plus the loop keys, kept as attributes."""

    model_type = nanbeige.MODEL_TYPE


def register() -> None:
    """Register the ``nanbeige`` config with transformers and the model with vLLM (idempotent)."""
    AutoConfig.register(nanbeige.MODEL_TYPE, NanbeigeHFConfig, exist_ok=True)
    ModelRegistry.register_model(ARCHITECTURE, NanbeigeForCausalLM)


def hobson_config(hf_config: Any) -> nanbeige.NanbeigeConfig:
    """Our :class:`~hobson.models.nanbeige.NanbeigeConfig` from vLLM's ``hf_config``: the same
    validation (unsupported features refused) and the values the math below uses."""
    d = hf_config.to_dict()
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"nanbeige config: rope_parameters {rope!r} is not supported (plain RoPE only)")
    if "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    d.pop("rope_scaling", None)  # transformers folds it into rope_parameters, checked above
    return nanbeige.NanbeigeConfig.from_dict(d)


class _SelfAttention(nn.Module):
    """q/k/v/o projections and RoPE of one decoder layer; the attention itself (and its KV cache)
    is the loop's ``Attention`` layer, passed in."""

    def __init__(self, cfg: nanbeige.NanbeigeConfig, quant_config: Any, max_model_len: int, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if cfg.num_attention_heads % tp or (
            cfg.num_key_value_heads % tp if cfg.num_key_value_heads >= tp else tp % cfg.num_key_value_heads
        ):
            raise ConfigError(
                f"nanbeige: {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads do not split over "
                f"tensor parallel size {tp}"
            )
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size=cfg.hidden_size,
            head_size=cfg.head_dim,
            total_num_heads=cfg.num_attention_heads,
            total_num_kv_heads=cfg.num_key_value_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=cfg.num_attention_heads * cfg.head_dim,
            output_size=cfg.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            cfg.head_dim,
            max_position=max_model_len,  # the cos/sin table vLLM indexes; positions never reach beyond
            is_neox_style=True,  # rotate-half, as the reference
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: nn.Module) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(attn(q, k, v))
        return out


class _MLP(nn.Module):
    def __init__(self, cfg: nanbeige.NanbeigeConfig, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(h))
        return out


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: nanbeige.NanbeigeConfig, quant_config: Any, max_model_len: int, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = _SelfAttention(cfg, quant_config, max_model_len, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = _MLP(cfg, quant_config, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: nn.Module) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class _NanbeigeModel(nn.Module):
    def __init__(self, cfg: nanbeige.NanbeigeConfig, vllm_config: Any, prefix: str) -> None:
        super().__init__()
        quant_config = vllm_config.quant_config
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            _DecoderLayer(cfg, quant_config, vllm_config.model_config.max_model_len, f"{prefix}.layers.{i}")
            for i in range(cfg.num_hidden_layers)
        )
        first = self.layers[0].self_attn  # heads per tensor-parallel rank
        # one Attention (hence one KV cache) per (loop, layer); no weights of its own
        self.loop_attn = nn.ModuleList(
            Attention(
                first.num_heads,
                cfg.head_dim,
                cfg.head_dim**-0.5,  # SDPA's default scale, as the reference
                num_kv_heads=first.num_kv_heads,
                cache_config=vllm_config.cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.loop_attn.{slot}",
            )
            for slot in range(cfg.num_hidden_layers * cfg.num_loops)
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        n_layers = self.cfg.num_hidden_layers
        for loop in range(self.cfg.num_loops):
            for i, layer in enumerate(self.layers):
                x = layer(positions, x, self.loop_attn[i + loop * n_layers])
            if loop == self.cfg.num_loops - 1 or not self.cfg.skip_loop_final_norm:
                x = self.norm(x)
        return x


class NanbeigeForCausalLM(nn.Module):
    """vLLM model class (registered as :data:`ARCHITECTURE`); parameters under the official names,
    with vLLM's fused ``qkv_proj`` and ``gate_up_proj`` filled from ``q/k/v_proj`` and ``gate/up_proj``."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        if get_pp_group().world_size > 1:
            raise ConfigError("nanbeige on vLLM: pipeline parallelism is not supported (every loop needs every layer)")
        cfg = hobson_config(vllm_config.model_config.hf_config)
        self.config = vllm_config.model_config.hf_config
        self.model = _NanbeigeModel(cfg, vllm_config, f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.lm_head" if prefix else "lm_head",
        )
        self.logits_processor = LogitsProcessor(cfg.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    _STACKED = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by official name; an unknown name (e.g. a critic's ``value_head``)
        is refused. Looks the parameters up on every call: an in-place reload swaps in wrapped ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = name, None
            for fused, part, part_shard in self._STACKED:
                if part in name:
                    target, shard = name.replace(part, fused), part_shard
                    break
            param = params.get(target)
            if param is None:
                raise ConfigError(f"nanbeige on vLLM: checkpoint tensor {name!r} has no place in the model")
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        return loaded
