"""Rendering rows into token ids and padded batches, with per-draw option order and phrasing.

A row renders as the teacher's prompt (:mod:`hobson.labels.prompt`), in the drawn option order
and instruction phrasing::

    [BOS] {state}\\n\\n {instruction}\\n\\n A. {name}: {description} \\n B. ... \\n Answer:

Each piece is tokenized on its own and the ids concatenated, so the positions the heads read are
exact: the key of option ``j`` is the last token of its line (before the newline), the query is
the last token of ``Answer:``. Over-long rows lose *state* tokens from the left; the
instruction and options are never cut (a row whose options alone exceed ``max_length`` is an
error).

Every draw (option permutation, then phrasing index, per row, in row order) comes from one
numpy PCG64 stream seeded once; :meth:`Collator.skip` makes the same draws without tokenizing, so
a DDP rank that skips the micro-batches other ranks train stays in the exact state one process
would be in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hobson.errors import DataError
from hobson.labels.prompt import ANSWER_CUE, LETTERS


def option_tag(j: int) -> str:
    """The tag of rendered slot ``j``: ``A``..``Z``, then ``27``, ``28``, ... (pointer head only)."""
    return LETTERS[j] if j < len(LETTERS) else str(j + 1)


def option_line(j: int, name: str, description: str) -> str:
    return f"{option_tag(j)}. {name}: {description}" if description else f"{option_tag(j)}. {name}"


def token_lengths(tokenizer: Any, rows: Sequence[Mapping[str, Any]], *, max_length: int, force_bos: bool,
                  chunk: int = 4096) -> list[int]:
    """Each row's rendered length in tokens, as training renders it (state cut to ``max_length``)
    but in canonical option order with the base instruction: the key rows are grouped by. Option
    lines are tokenized one by one, so a drawn order changes only the option tags; a drawn
    phrasing changes it by that phrasing's own difference. Draws no RNG."""
    canonical = Collator(tokenizer, max_length=max_length, force_bos=force_bos, seed=0, shuffle=False)
    out: list[int] = []
    for start in range(0, len(rows), chunk):
        part = list(enumerate(rows[start: start + chunk], start))
        out.extend(len(ids) for ids, _, _ in canonical.render(part))
    return out


def phrasings(row: Mapping[str, Any]) -> list[str]:
    """The instruction phrasings a draw chooses from: ``instructions`` then each variant."""
    return [row["instructions"], *row.get("instruction_variants", [])]


@dataclass
class Batch:
    """One padded micro-batch. ``(B, T)`` tokens, ``(B, N)`` option slots in rendered order."""

    input_ids: torch.Tensor  # (B, T) long, right-padded
    attention_mask: torch.Tensor  # (B, T) long
    answer_pos: torch.Tensor  # (B,) position of the query token
    option_pos: torch.Tensor  # (B, N) position of each rendered option's key token (0 in padding)
    option_mask: torch.Tensor  # (B, N) bool
    perm: torch.Tensor  # (B, N) canonical index of rendered slot j (j itself in padding)
    label: torch.Tensor  # (B,) canonical label
    is_score: torch.Tensor  # (B,) bool
    weight: torch.Tensor  # (B,) float
    teacher: torch.Tensor  # (B, N) canonical-order teacher probabilities (0 where absent)
    has_teacher: torch.Tensor  # (B,) bool
    row_index: list[int]  # global training-row index of each row
    token_ids: list[list[int]]  # each row's unpadded ids (for traces and tests)

    def to(self, device: torch.device | str) -> Batch:
        """The batch on ``device``. To a GPU through pinned memory, without waiting: a copy from
        pageable memory synchronizes the stream, so each micro-batch's copy would wait for the
        previous one's backward to finish on the GPU before the host could queue anything more."""
        if torch.device(device).type == "cuda":
            def move(v: torch.Tensor) -> torch.Tensor:
                return v.pin_memory().to(device, non_blocking=True) if v.device.type == "cpu" else v.to(device)
        else:
            def move(v: torch.Tensor) -> torch.Tensor:
                return v.to(device)
        return Batch(**{k: (move(v) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


def to_canonical(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rendered-order ``(B, N)`` values into canonical order: ``out[b, perm[b, j]] = x[b, j]``."""
    return torch.scatter(torch.zeros_like(x), 1, perm, x)


class Collator:
    """Renders rows with drawn option order and phrasing; pads them into a :class:`Batch`.

    ``shuffle=False`` renders canonical order with the base instruction and draws nothing
    (validation, labelling).
    """

    def __init__(self, tokenizer: Any, *, max_length: int, force_bos: bool, seed: int, shuffle: bool = True,
                 teacher: Mapping[int, Sequence[float]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.shuffle = shuffle
        self.teacher = teacher or {}
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.bos = []
        if force_bos:
            if tokenizer.bos_token_id is None:
                raise DataError("force_bos is set but the tokenizer has no BOS token; set force_bos: false")
            self.bos = [tokenizer.bos_token_id]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.newline = self._encode(["\n"])[0]
        self.answer = self._encode([ANSWER_CUE])[0]

    # --- RNG -------------------------------------------------------------------------------
    def _draw(self, row: Mapping[str, Any]) -> tuple[list[int], int]:
        """(rendered order as canonical indices, phrasing index): the only RNG use per row."""
        n = len(row["options"])
        if not self.shuffle:
            return list(range(n)), 0
        order = self.rng.permutation(n).tolist()
        k = int(self.rng.integers(len(phrasings(row))))
        return order, k

    def skip(self, rows: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        """Advance the RNG exactly as :meth:`collate` of ``rows`` would, without tokenizing."""
        for _, row in rows:
            self._draw(row)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]

    # --- rendering ---------------------------------------------------------------------------
    def _encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def render(self, rows: Sequence[tuple[int, Mapping[str, Any]]]) -> list[tuple[list[int], list[int], list[int]]]:
        """``(ids, option key positions in rendered order, rendered order)`` per row; draws RNG."""
        draws = [self._draw(row) for _, row in rows]
        texts: list[str] = []
        for (_, row), (order, k) in zip(rows, draws, strict=True):
            state = row["state"]
            texts.append(state + "\n\n" if state else "")
            texts.append(phrasings(row)[k] + "\n\n")
            texts.extend(option_line(j, *row["options"][c]) for j, c in enumerate(order))
        pieces = self._encode(texts)
        out = []
        at = 0
        for (index, _row), (order, _) in zip(rows, draws, strict=True):
            n = len(order)
            state_ids, instr_ids, lines = pieces[at], pieces[at + 1], pieces[at + 2: at + 2 + n]
            at += 2 + n
            fixed = len(self.bos) + len(instr_ids) + sum(len(x) + len(self.newline) for x in lines) + len(self.answer)
            if fixed > self.max_length:
                raise DataError(f"training row {index}: instruction and options take {fixed} tokens, more than "
                                f"max_length {self.max_length}; raise max_length (state is cut, options never)")
            room = self.max_length - fixed
            if len(state_ids) > room:
                state_ids = state_ids[len(state_ids) - room:] if room else []
            ids = self.bos + state_ids + instr_ids
            keys = []
            for line in lines:
                ids = ids + line
                keys.append(len(ids) - 1)
                ids = ids + self.newline
            ids = ids + self.answer
            out.append((ids, keys, order))
        return out

    def collate(self, rows: Sequence[tuple[int, Mapping[str, Any]]]) -> Batch:
        """Render and pad ``rows`` (``(global index, row)`` pairs) into one batch."""
        rendered = self.render(rows)
        T = max(len(ids) for ids, _, _ in rendered)
        N = max(len(order) for _, _, order in rendered)
        # each field built as Python lists and turned into a tensor once: per-row writes into
        # tensors were a dozen torch ops a row, host time the GPU waits through at a step's start
        lengths = [len(ids) for ids, _, _ in rendered]
        teacher: list[list[float]] = []
        for (index, _row), (_, _, order) in zip(rows, rendered, strict=True):
            probs = self.teacher.get(index)
            if probs is not None and len(probs) != len(order):
                raise DataError(f"teacher line i={index} has {len(probs)} probs for a row with {len(order)} options")
            teacher.append([] if probs is None else list(probs))
        input_ids = torch.tensor([ids + [self.pad_id] * (T - len(ids)) for ids, _, _ in rendered], dtype=torch.long)
        attention_mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths], dtype=torch.long)
        answer_pos = torch.tensor([n - 1 for n in lengths], dtype=torch.long)
        option_pos = torch.tensor([keys + [0] * (N - len(keys)) for _, keys, _ in rendered], dtype=torch.long)
        option_mask = torch.tensor([[True] * len(o) + [False] * (N - len(o)) for _, _, o in rendered], dtype=torch.bool)
        perm = torch.tensor([list(o) + list(range(len(o), N)) for _, _, o in rendered], dtype=torch.long)
        label = torch.tensor([row["label"] for _, row in rows], dtype=torch.long)
        is_score = torch.tensor([row["kind"] == "score" for _, row in rows], dtype=torch.bool)
        weight = torch.tensor([float(row["weight"]) for _, row in rows], dtype=torch.float32)
        has_teacher = torch.tensor([self.teacher.get(i) is not None for i, _ in rows], dtype=torch.bool)
        teacher_t = torch.tensor([p + [0.0] * (N - len(p)) for p in teacher], dtype=torch.float32)
        return Batch(input_ids, attention_mask, answer_pos, option_pos, option_mask, perm, label, is_score, weight,
                     teacher_t, has_teacher, [i for i, _ in rows], [ids for ids, _, _ in rendered])
