"""The decider: a LoRA-adapted causal-LM torso (LM head dropped) with an option readout.

- **Pointer head**: query ``q = Q(h_answer)``, key ``k_j = K(h_j)`` from the last token of option
  line ``j``, logit ``k_j . q / sqrt(pointer_dim)``; any number of options.
- **Slot head**: ``num_slots`` logits from ``h_answer``; rendered slot ``j`` takes logit ``j``.
- **Frozen readout** (the KL anchor): the same torso with the adapter disabled
  (every LoRA layer's disabled flag set, as ``peft``'s ``disable_adapter()`` does), read through
  its own (frozen, kept) LM head at the answer position over the option-letter tokens ``A``,
  ``B``, ... (:func:`hobson.labels.prompt.letter_token_ids`),
  with the final-logit soft-cap where the config has one (Gemma).

Heads run in fp32 whatever the torso dtype (fp32 on CPU, bf16 on GPU when asked).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hobson.attention import mask_mapping, supports_mask_mapping, varying_shape_sdpa
from hobson.decider.collate import Batch
from hobson.decider.fusion import fuse_chains, fuse_lora, lora_is_fused, resolve_chain_kernel
from hobson.errors import ConfigError, DataError
from hobson.labels.prompt import MAX_OPTIONS, letter_token_ids


def _projection(hidden: int, out: int, head_hidden: int) -> nn.Module:
    if head_hidden == 0:
        return nn.Linear(hidden, out)
    return nn.Sequential(nn.Linear(hidden, head_hidden), nn.GELU(), nn.Linear(head_hidden, out))


class PointerHead(nn.Module):
    def __init__(self, hidden: int, pointer_dim: int, head_hidden: int = 0) -> None:
        super().__init__()
        self.pointer_dim = pointer_dim
        self.query = _projection(hidden, pointer_dim, head_hidden)
        self.key = _projection(hidden, pointer_dim, head_hidden)

    def forward(self, answer: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        """``answer (B, H)``, ``options (B, N, H)`` -> logits ``(B, N)``."""
        q = self.query(answer)  # (B, D)
        k = self.key(options)  # (B, N, D)
        return torch.einsum("bnd,bd->bn", k, q) / math.sqrt(self.pointer_dim)


class SlotHead(nn.Module):
    def __init__(self, hidden: int, num_slots: int, head_hidden: int = 0) -> None:
        super().__init__()
        self.num_slots = num_slots
        self.out = _projection(hidden, num_slots, head_hidden)

    def forward(self, answer: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        N = options.shape[1]
        if N > self.num_slots:
            raise DataError(f"a row has {N} options but the slot head has num_slots={self.num_slots}; "
                            "raise num_slots or use head_type: pointer")
        return self.out(answer)[:, :N]


class EnsembleHead(nn.Module):
    """``N`` heads of one type whose logits are averaged: the readout of a soup of ``N`` models.

    ``logits = (1/N) sum_i head_i(answer, options)``; the state dict holds ``heads.<i>.<name>``.
    """

    def __init__(self, heads: list[nn.Module]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)

    def forward(self, answer: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        return torch.stack([h(answer, options) for h in self.heads]).mean(0)


def build_head(head_type: str, hidden: int, *, pointer_dim: int, num_slots: int, head_hidden: int,
               ensemble: int = 1) -> nn.Module:
    """One head, or an :class:`EnsembleHead` of ``ensemble`` heads (a soup's readout)."""
    if ensemble > 1:
        return EnsembleHead([build_head(head_type, hidden, pointer_dim=pointer_dim, num_slots=num_slots,
                                        head_hidden=head_hidden) for _ in range(ensemble)])
    if head_type == "pointer":
        return PointerHead(hidden, pointer_dim, head_hidden)
    if head_type == "slot":
        return SlotHead(hidden, num_slots, head_hidden)
    raise ConfigError(f"head_type {head_type!r} is not one of pointer, slot")


class Decider(nn.Module):
    """Torso (optionally a ``PeftModel``) + head; ``forward(batch)`` gives rendered-order logits.

    ``forward(None)`` returns a zero that touches every trainable parameter: a DDP rank with no
    micro-batch in a step backpropagates it so it still joins the gradient all-reduce.
    """

    def __init__(self, torso: nn.Module, head: nn.Module, *, use_lora: bool,
                 lm_head_weight: torch.Tensor | None = None, letter_ids: list[int] | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.torso = torso
        self.head = head
        self.use_lora = use_lora
        self.softcap = softcap
        # A buffer, not a parameter: DDP and the optimizer never see it; non-persistent so it
        # stays out of state dicts (it is the base model's own, reloaded with the torso).
        self.register_buffer("lm_head_weight", lm_head_weight, persistent=False)
        self.letter_ids = letter_ids
        # the same ids on the model's device: indexing a GPU tensor with a list copies the list from
        # pageable host memory on every frozen readout, a sync
        self.register_buffer("letter_index", None if letter_ids is None else torch.tensor(letter_ids),
                             persistent=False)
        # False when the frozen-KL targets were precomputed before step 1 (no second forward).
        self.compute_frozen = True
        self.chain_kernel = "eager"  # what build_decider resolved chain_kernel to (run control)
        self._lora_layers: list[nn.Module] | None = None  # adapters_off's layers, found once

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def _hidden(self, batch: Batch) -> torch.Tensor:
        mask: Any = batch.attention_mask
        config = getattr(self.torso, "config", None)
        if config is not None and supports_mask_mapping(config):
            # whether any row is padded, from the host's lists: transformers would read it from the
            # device mask, a sync per forward (hobson.attention.mask_mapping)
            T = batch.input_ids.shape[1]
            padded = any(len(ids) < T for ids in batch.token_ids)
            mask = mask_mapping(config, batch.attention_mask, padded, self.torso.get_input_embeddings().weight.dtype)
        with varying_shape_sdpa():
            # use_cache=False: transformers otherwise builds a cache on every forward (the config's
            # default), storing each layer's keys, values and recurrent states that nothing reads
            return self.torso(input_ids=batch.input_ids, attention_mask=mask, use_cache=False).last_hidden_state

    def forward(self, batch: Batch | None) -> dict[str, torch.Tensor | None]:
        if batch is None:
            return {"zero": sum(p.sum() for p in self.trainable_parameters()) * 0.0}
        hidden = self._hidden(batch)  # (B, T, H)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        answer = hidden[rows, batch.answer_pos].float()  # (B, H)
        options = hidden[rows[:, None], batch.option_pos].float()  # (B, N, H)
        logits = self.head(answer, options)
        frozen = (self.frozen_logits(batch, hidden)
                  if self.lm_head_weight is not None and self.compute_frozen else None)
        return {"logits": logits, "frozen_logits": frozen}

    @torch.no_grad()
    def frozen_logits(self, batch: Batch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen torso's option-letter logits ``(B, N)`` in rendered order (no gradient)."""
        N = batch.option_pos.shape[1]
        if N > MAX_OPTIONS:
            raise DataError(f"a row has {N} options; the frozen readout reads letters A..Z, so at most "
                            f"{MAX_OPTIONS} (set kl_frozen_weight: 0 for longer option lists)")
        if self.use_lora:
            with self.adapters_off():
                hidden = self._hidden(batch)
        elif hidden is None:
            hidden = self._hidden(batch)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        answer = hidden[rows, batch.answer_pos]  # (B, H)
        w = self.lm_head_weight[self.letter_index[:N]]  # (N, H)
        logits = (answer @ w.T).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The torso without its adapter, for the block: each LoRA layer's disabled flag set, then
        restored. peft's ``disable_adapter()`` does the same, but first builds a status report of
        every layer (module reprs included) and resets the adapters' ``requires_grad`` on the way
        out: ~7 ms of host time per 8-layer forward on a CPU, paid every step by the frozen KL."""
        if self._lora_layers is None:
            self._lora_layers = [m for m in self.torso.modules() if hasattr(m, "_disable_adapters")]
        before = [m._disable_adapters for m in self._lora_layers]
        for m in self._lora_layers:
            m._disable_adapters = True
        try:
            yield
        finally:
            for m, flag in zip(self._lora_layers, before, strict=True):
                m._disable_adapters = flag

    def adapter_state(self) -> dict[str, torch.Tensor]:
        if not self.use_lora:
            return {}
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(self.torso).items()}

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        if not self.use_lora:
            if state:
                raise ConfigError("the checkpoint holds a LoRA adapter but use_lora is false")
            return
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.torso, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ConfigError(f"adapter keys not in this model: {', '.join(unexpected[:5])}")

    def head_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().contiguous() for k, v in self.head.state_dict().items()}


def text_decoder(lm: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM; for a multimodal wrapper (Gemma 3/3n/4) its text model.

    ``Gemma4ForConditionalGeneration.model`` holds ``language_model`` beside vision and audio
    encoders; only the language model is kept (the encoders are dropped with the wrapper), so LoRA
    targets such as ``q_proj`` never match a vision or audio module.
    """
    inner = lm.base_model
    text = getattr(inner, "language_model", None)
    return inner if text is None else text


PER_LAYER_EMBEDDINGS = ("embed_tokens_per_layer",)


def keep_embeddings_on_host(torso: nn.Module) -> list[str]:
    """Leave the per-layer embedding tables (Gemma 3n/4) in host memory when the torso moves to a GPU.

    The table's module is pinned to the CPU: ``Module.to``/``cuda`` skip it (its ``_apply`` is a
    no-op), its input ids are moved to the CPU and its output back to the ids' device by hooks.
    One process only: under torchrun every rank would hold its own copy in host memory.
    """
    names = []
    for name, module in torso.named_modules():
        if name.rsplit(".", 1)[-1] not in PER_LAYER_EMBEDDINGS:
            continue
        module._apply = _stay_put(module)  # type: ignore[method-assign]
        module.register_forward_pre_hook(_ids_to_host)
        module.register_forward_hook(_output_to_ids_device)
        names.append(name)
    return names


def _stay_put(module: nn.Module):
    def _apply(fn, *args, **kwargs):
        return module
    return _apply


def _ids_to_host(module: nn.Module, args: tuple) -> tuple:
    module._hobson_device = args[0].device
    return (args[0].cpu(), *args[1:])


def _output_to_ids_device(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.to(module._hobson_device)


def load_torso(path: str, *, dtype: torch.dtype, attn_implementation: str, keep_lm_head: bool,
               host_embeddings: bool = False, init: str = "pretrained", seed: int = 0,
               device: torch.device | str = "cpu") -> tuple[nn.Module, torch.Tensor | None, float | None]:
    """The causal LM's text decoder, its LM head weight if asked, its final-logit soft-cap.

    ``init="random"`` reads only ``<path>/config.json`` and initialises the model with
    ``from_config`` under ``torch.manual_seed(seed)``, created on ``device`` (a 2 B model
    initialises in seconds there, minutes on a CPU): the published shapes without their weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if init == "pretrained":
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    elif init == "random":
        config = AutoConfig.from_pretrained(path)
        torch.manual_seed(seed)
        with torch.device(device):
            lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    else:
        raise ConfigError(f"torso_init {init!r} is not one of pretrained, random")
    torso = text_decoder(lm)
    weight = lm.get_output_embeddings().weight.detach() if keep_lm_head else None
    config = getattr(lm.config, "text_config", lm.config)
    softcap = getattr(config, "final_logit_softcapping", None)
    if host_embeddings and not keep_embeddings_on_host(torso):
        raise ConfigError(f"host_embeddings: true but {path} has no per-layer embedding table "
                          f"({', '.join(PER_LAYER_EMBEDDINGS)}); set host_embeddings: false")
    return torso, weight, softcap


def build_decider(cfg: Any, tokenizer: Any, device: torch.device | str = "cpu") -> Decider:
    """Torso from ``cfg.base_model``, LoRA on ``cfg.lora_targets``, head; seeded by ``cfg.seed``."""
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    torso, lm_w, softcap = load_torso(cfg.base_model, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                      keep_lm_head=cfg.kl_frozen_weight > 0 and not cfg.kl_frozen_reference,
                                      host_embeddings=cfg.host_embeddings, init=cfg.torso_init, seed=cfg.seed,
                                      device=device)
    for p in torso.parameters():
        p.requires_grad_(False)
    if cfg.gradient_checkpointing:
        # Non-reentrant: works with a frozen embedding (no enable_input_require_grads) and with DDP.
        torso.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Seed after loading so LoRA A and the head draw the same numbers in every process.
    torch.manual_seed(cfg.seed)
    if cfg.use_lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_targets), bias="none")
        try:
            torso = get_peft_model(torso, lora)
        except ValueError as e:
            raise ConfigError(f"lora_targets {cfg.lora_targets}: {e}") from None
        if cfg.freeze_torso:  # the head trains alone; the adapter stays as init_from loads it
            for p in torso.parameters():
                p.requires_grad_(False)
        if lora_is_fused(cfg.lora_kernel, dtype):
            fuse_lora(torso)
    chains = resolve_chain_kernel(cfg.chain_kernel, device, dtype)
    if chains != "eager":
        fuse_chains(torso, chains)
    hidden = torso.config.hidden_size
    head = build_head(cfg.head_type, hidden, pointer_dim=cfg.pointer_dim, num_slots=cfg.num_slots,
                      head_hidden=cfg.head_hidden, ensemble=cfg.head_ensemble)
    letter_ids = letter_token_ids(tokenizer) if lm_w is not None else None
    model = Decider(torso, head, use_lora=cfg.use_lora, lm_head_weight=lm_w, letter_ids=letter_ids, softcap=softcap)
    model.chain_kernel = chains
    return model.to(device)
