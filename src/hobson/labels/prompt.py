"""Rendering a corpus row as a multiple-choice prompt, and the option letters' token ids.

The teacher reads its answer off the next-token logits at the end of the prompt: one logit per
option letter, softmaxed over the row's letters only. So each letter must be exactly one token.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from hobson.errors import ConfigError, DataError

LETTERS = string.ascii_uppercase
MAX_OPTIONS = len(LETTERS)
ANSWER_CUE = "Answer:"


def render_prompt(row: dict[str, Any]) -> str:
    """``state``, ``instructions``, one ``"A. name: description"`` line per option, ``"Answer:"``.

    Empty parts are left out rather than rendered as blank lines. Options are lettered in
    canonical order (the order in the corpus file), which is also the order of ``probs``.
    """
    options = row["options"]
    if len(options) > MAX_OPTIONS:
        raise DataError(f"{len(options)} options; the prompt letters options A..Z, so at most {MAX_OPTIONS}")
    parts = [p for p in (row.get("state", ""), row.get("instructions", "")) if p]
    lines = []
    for letter, (name, description) in zip(LETTERS, options, strict=False):
        lines.append(f"{letter}. {name}: {description}" if description else f"{letter}. {name}")
    parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n" + ANSWER_CUE


def letter_token_ids(tokenizer: Any) -> list[int]:
    """Token ids of the 26 answer letters, as the model would emit them after ``"Answer:"``.

    Prefers ``" A"``..``" Z"`` (what GPT-style BPEs emit after a colon); if any of them is not a
    single token, uses ``"A"``..``"Z"`` for all 26 (sentencepiece vocabularies, hobson's tiny
    byte-level BPE). The choice depends on the tokenizer only, never on a row.
    """
    for form in (" {}", "{}"):
        ids = [tokenizer(form.format(c), add_special_tokens=False)["input_ids"] for c in LETTERS]
        if all(len(x) == 1 for x in ids):
            return [x[0] for x in ids]
    bad = [c for c, x in zip(LETTERS, ids, strict=True) if len(x) != 1]
    raise ConfigError(f"the tokenizer splits the option letters {''.join(bad)} into several tokens; "
                      "the teacher needs every letter A..Z (or ' A'..' Z') to be one token")


def check_option_counts(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Refuse, naming ``file:line``, any row with more options than there are letters."""
    for i, row in enumerate(rows):
        n = len(row["options"])
        if n > MAX_OPTIONS:
            raise DataError(f"{path}:{i + 1}: {n} options; the teacher prompt letters options A..Z, "
                            f"so at most {MAX_OPTIONS}")
