"""The teacher scorer: a causal LM's next-token distribution over the option letters.

Batches are left padded, with position ids counted from each row's first real token, so every
row's last real token sits at the last position and one logit row per sequence is computed
(``logits_to_keep=1``) instead of a full-vocabulary logit for every position.

:attr:`LMOptionScorer.forward_seconds` adds up the wall seconds of the model's part of each
batch (inputs to the device, the forward, the letter logits back on the host), which is how a
benchmark separates the model from tokenizing, packing and writing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from hobson.errors import ConfigError
from hobson.labels.prompt import letter_token_ids, render_prompt


class LMOptionScorer:
    """Scores rows with ``model`` (any HF causal LM) and ``tokenizer``; see ``RowScorer``."""

    def __init__(self, model: Any, tokenizer: Any, device: str = "cpu") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.letter_ids = letter_token_ids(tokenizer)
        pad = tokenizer.pad_token_id
        # Pad positions are masked out, so any id works when a tokenizer has no pad token.
        self.pad_id = pad if pad is not None else 0
        self._ids: dict[str, Any] = {}
        # Seconds of every score_batch's device part so far; the copy of the letter logits to the
        # host waits for the forward, so the clock stops when the device is done (no extra sync).
        self.forward_seconds = 0.0

    def encode(self, row: dict[str, Any]) -> list[int]:
        return self.tokenizer(render_prompt(row))["input_ids"]

    def _encode_many(self, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """Token ids of each row's prompt: tokenised in one batched call, kept for the scoring pass
        (the labeller asks for every length first, then scores the same rows), int32 to stay small."""
        import numpy as np

        texts = [render_prompt(r) for r in rows]
        missing = [t for t in dict.fromkeys(texts) if t not in self._ids]
        if missing:
            for t, ids in zip(missing, self.tokenizer(missing)["input_ids"], strict=True):
                self._ids[t] = np.asarray(ids, dtype=np.int32)
        return [self._ids[t] for t in texts]

    def lengths(self, rows: Sequence[dict[str, Any]]) -> list[int]:
        return [len(x) for x in self._encode_many(rows)]

    def score_batch(self, rows: Sequence[dict[str, Any]]) -> list[list[float]]:
        import time

        import torch

        from hobson.attention import varying_shape_sdpa

        ids = self._encode_many(rows)
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for k, x in enumerate(ids):
            input_ids[k, width - len(x):] = torch.from_numpy(x).long()
            mask[k, width - len(x):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        start = time.perf_counter()
        with torch.inference_mode(), varying_shape_sdpa():
            logits = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                logits_to_keep=1,
                use_cache=False,  # no cache for one forward (the config's default builds one)
            ).logits[:, -1, :]  # (B, V): the next-token logits after each row's last real token
            # one copy to the host per batch; a softmax per row on the device would wait on it per row
            letters = logits[:, self.letter_ids].float().cpu()  # (B, 26)
            self.forward_seconds += time.perf_counter() - start
            return [torch.softmax(letters[k, : len(row["options"])], dim=-1).tolist() for k, row in enumerate(rows)]


def load_causal_lm(
    model_dir: str | os.PathLike, device: str = "cpu", dtype: str = "float32"
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local HF directory, in eval mode on ``device``; no download."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(model_dir):
        raise ConfigError(f"--teacher {model_dir}: not a directory "
                          "(expected a local Hugging Face causal-LM directory)")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model = model.to(device=device, dtype=torch_dtype).eval()
    return model, tokenizer
