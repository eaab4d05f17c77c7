"""Loading a decider checkpoint for inference, and its option probabilities on corpus rows.

Inference renders every row in canonical option order with its base instruction (the collator
with ``shuffle=False``), so the logits come out in canonical order, the order of ``label`` and of
a label file's ``probs``. Rows are batched shortest first in fixed-size batches (or by the
labelling planner, :mod:`hobson.labels`, for replay), so the result is a function of the rows.

Temperatures (``temperatures.json``): ``{"global": T, "per_kind": {"score": T_s, ...}}``. A row
of kind ``k`` divides its logits by ``per_kind[k]`` when present, else by ``global``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hobson.config import config_from_dict
from hobson.decider.checkpoint import DEFAULT_TEMPERATURES, load_checkpoint
from hobson.decider.collate import Collator
from hobson.decider.config import TrainConfig
from hobson.decider.model import Decider, build_decider
from hobson.errors import DataError


@dataclass
class LoadedDecider:
    """A checkpoint ready for inference: model (eval mode), tokenizer, config, temperatures."""

    model: Decider
    tokenizer: Any
    config: TrainConfig
    temperatures: dict[str, Any]
    path: str
    device: torch.device

    def collator(self) -> Collator:
        return Collator(self.tokenizer, max_length=self.config.max_length, force_bos=self.config.force_bos,
                        seed=0, shuffle=False)


def checkpoint_config(saved: Mapping[str, Any], origin: str) -> TrainConfig:
    """The saved config dict as a :class:`TrainConfig` (keys a newer version added take defaults)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return config_from_dict({k: v for k, v in saved.items() if k in names}, TrainConfig, origin=origin)


def load_decider(path: str | os.PathLike, device: str | torch.device = "cpu",
                 base_model: str | None = None) -> LoadedDecider:
    """Build the checkpoint's torso + LoRA + head and load its weights (no LM head, no frozen KL).

    ``base_model`` replaces the recorded torso path (a checkpoint moved to another machine).
    """
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ckpt = load_checkpoint(path, trainer_state=False)
    cfg = checkpoint_config(ckpt.config, f"{path}/config.json")
    # Inference needs neither the frozen readout nor a reference model nor a parent to start from.
    replace: dict[str, Any] = {"kl_frozen_weight": 0.0, "gradient_checkpointing": False, "freeze_torso": False,
                               "precompute_frozen_kl": False}
    for key in ("init_from", "kl_frozen_reference"):
        if hasattr(cfg, key):
            replace[key] = None
    if base_model:
        replace["base_model"] = base_model
    cfg = dataclasses.replace(cfg, **replace)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.base_model)
    device = torch.device(device)
    model = build_decider(cfg, tokenizer, device)
    model.load_adapter_state(ckpt.adapter)
    model.head.load_state_dict(ckpt.head)
    model.eval()
    return LoadedDecider(model, tokenizer, cfg, dict(ckpt.temperatures), str(path), device)


def row_temperature(temperatures: Mapping[str, Any], kind: str) -> float:
    per_kind = temperatures.get("per_kind") or {}
    return float(per_kind.get(kind, temperatures.get("global", 1.0)))


@torch.no_grad()
def batch_logits(loaded: LoadedDecider, rows: Sequence[Mapping[str, Any]], collator: Collator | None = None,
                 ) -> list[list[float]]:
    """Raw canonical-order logits of one batch of rows (one padded forward)."""
    collator = collator or loaded.collator()
    batch = collator.collate(list(enumerate(rows))).to(loaded.device)
    hidden = loaded.model._hidden(batch)  # (B, T, H)
    r = torch.arange(hidden.shape[0], device=hidden.device)
    logits = loaded.model.head(hidden[r, batch.answer_pos].float(), hidden[r[:, None], batch.option_pos].float())
    return [logits[b, : len(row["options"])].double().cpu().tolist() for b, row in enumerate(rows)]


def rendered_lengths(loaded: LoadedDecider, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    collator = loaded.collator()
    return [len(ids) for ids, _, _ in collator.render(list(enumerate(rows)))]


def predict_logits(loaded: LoadedDecider, rows: Sequence[Mapping[str, Any]], batch_size: int = 32,
                   ) -> list[list[float]]:
    """Raw logits for every row (canonical order), batched shortest first in ``batch_size`` rows."""
    lengths = rendered_lengths(loaded, rows)
    order = sorted(range(len(rows)), key=lambda i: (lengths[i], i))
    out: list[list[float] | None] = [None] * len(rows)
    collator = loaded.collator()
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        for i, z in zip(idx, batch_logits(loaded, [rows[i] for i in idx], collator), strict=True):
            out[i] = z
    return out  # type: ignore[return-value]


def softmax(logits: Sequence[float], temperature: float = 1.0) -> list[float]:
    """Float64 softmax of ``logits / temperature``."""
    z = torch.tensor(logits, dtype=torch.float64) / temperature
    return torch.softmax(z, dim=0).tolist()


def probabilities(logits: Sequence[Sequence[float]], rows: Sequence[Mapping[str, Any]],
                  temperatures: Mapping[str, Any] | None = None) -> list[list[float]]:
    """Per-row probabilities after each row's temperature (see the module docstring)."""
    temps = temperatures or DEFAULT_TEMPERATURES
    return [softmax(z, row_temperature(temps, row["kind"])) for z, row in zip(logits, rows, strict=True)]


class DeciderScorer:
    """A :class:`hobson.labels.RowScorer` from a decider: its own (uncalibrated) distribution.

    ``lengths`` are the rendered token counts, so the labelling planner batches rows exactly as
    they are padded; each batch is one forward, whichever shard computes it.
    """

    def __init__(self, loaded: LoadedDecider, use_temperatures: bool = False) -> None:
        self.loaded = loaded
        self.collator = loaded.collator()
        self.temperatures = loaded.temperatures if use_temperatures else DEFAULT_TEMPERATURES

    def lengths(self, rows: Sequence[dict[str, Any]]) -> list[int]:
        return rendered_lengths(self.loaded, rows)

    def score_batch(self, rows: Sequence[dict[str, Any]]) -> list[list[float]]:
        logits = batch_logits(self.loaded, rows, self.collator)
        return probabilities(logits, rows, self.temperatures)


def check_rows_fit(rows: Sequence[Mapping[str, Any]], cfg: TrainConfig, path: str) -> None:
    if cfg.head_type == "slot":
        for i, row in enumerate(rows):
            if len(row["options"]) > cfg.num_slots:
                raise DataError(f"{path}:{i + 1}: {len(row['options'])} options but the checkpoint's slot head "
                                f"has num_slots={cfg.num_slots}")
