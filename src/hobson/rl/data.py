"""Prompts for RL: JSONL rows with a string ``prompt`` and a string ``label``; tokenisation.

A row that is not an object, lacks either key, or holds a non-string there raises
:class:`~hobson.errors.DataError` naming ``file:line``. The embedded default data
(``default_data.jsonl`` beside this module) is 64 arithmetic questions whose answer is the
``\\boxed{}`` integer in ``label``.

Tokenisers: a model directory with tokenizer files gets its HF tokenizer; the embedded tiny
models (vocabulary 256) use :class:`ByteTokenizer` (token id = UTF-8 byte, id 0 = end of text).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hobson.errors import DataError
from hobson.io import iter_jsonl, sha256_file

DEFAULT_DATA = Path(__file__).with_name("default_data.jsonl")


@dataclass(frozen=True)
class PromptRow:
    line: int  # 1-based line in the data file
    prompt: str
    label: str


def load_prompts(path: str | os.PathLike) -> list[PromptRow]:
    """Every row of ``path``; a malformed row raises ``DataError("file:line: ...")``."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file (the RL data is a JSONL of string 'prompt' and 'label' per row)")
    rows = []
    for lineno, obj in iter_jsonl(path):
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected an object with 'prompt' and 'label', got {type(obj).__name__}")
        for key in ("prompt", "label"):
            if key not in obj:
                raise DataError(f"{path}:{lineno}: missing {key!r} (each row needs string 'prompt' and 'label')")
            if not isinstance(obj[key], str):
                raise DataError(f"{path}:{lineno}: {key!r} must be a string, got {type(obj[key]).__name__}")
        rows.append(PromptRow(lineno, obj["prompt"], obj["label"]))
    if not rows:
        raise DataError(f"{path}:1: no rows (the RL data needs at least one prompt)")
    return rows


def data_digest(path: str | os.PathLike) -> str:
    return sha256_file(path)


def batch_rows(rows: list[PromptRow], cursor: int, n: int) -> list[tuple[int, PromptRow]]:
    """``n`` rows starting at ``cursor``, wrapping around; returns ``(absolute index, row)``."""
    return [(cursor + i, rows[(cursor + i) % len(rows)]) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Tokenisers


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte; id 0 (NUL, never in text) ends a completion and pads."""

    eos_id = 0
    pad_id = 0
    vocab_size = 256
    name = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        return [b for b in text.encode("utf-8") if b]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``transformers`` tokenizer from a model directory."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        self.tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_id = int(self.tok.eos_token_id)
        self.pad_id = int(self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id)
        self.vocab_size = len(self.tok)
        self.name = f"hf:{Path(model_dir).name}"

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_for(model_dir: str | os.PathLike | None, vocab_size: int) -> Tokenizer:
    """The model directory's own tokenizer, else the byte tokenizer (needs a vocabulary >= 256)."""
    if model_dir is not None and any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES):
        return HFTokenizer(model_dir)
    if vocab_size < ByteTokenizer.vocab_size:
        raise DataError(f"{model_dir}: no tokenizer files and vocab_size {vocab_size} < 256 (the byte tokenizer)")
    return ByteTokenizer()


def drop_long_prompts(
    rows: list[PromptRow], tok: Tokenizer, max_tokens: int, mode: str, path: str | os.PathLike
) -> tuple[list[PromptRow], list[PromptRow]]:
    """``(kept, dropped)``: with ``mode`` "drop" (VIME's ``filter_long_prompt``) the rows whose
    prompt encodes to more than ``max_tokens`` tokens are left out; "truncate" keeps every row
    (:func:`encode_prompt` keeps the last tokens). Nothing left is an error naming the file."""
    if mode == "truncate":
        return rows, []
    kept, dropped = [], []
    for r in rows:
        (kept if len(tok.encode(r.prompt)) <= max_tokens else dropped).append(r)
    if not kept:
        raise DataError(
            f"{path}:{rows[0].line}: every one of the {len(rows)} prompts is longer than max_prompt_tokens "
            f"({max_tokens} tokens); raise --max-prompt-tokens or pass --long-prompts truncate"
        )
    return kept, dropped


def encode_prompt(tok: Tokenizer, text: str, max_tokens: int) -> list[int]:
    """Token ids of ``text``, keeping the last ``max_tokens`` (the question sits at the end)."""
    ids = tok.encode(text)
    return ids[-max_tokens:] if len(ids) > max_tokens else ids
