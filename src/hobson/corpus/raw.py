"""Raw sources the corpus stages know how to read, as listed in ``D/raw/MANIFEST.json``.

One format is defined: ``qa-jsonl``, read by ``build``. Each line is
``{"question": str, "options": [str, ...], "answer": int}`` with optional ``"context"``
(facts shown before the question) and ``"task"``. The split is decided by a digest of the
row's state, so identical questions always land in the same split and never leak.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hobson.corpus.generator import Row
from hobson.corpus.schema import make_row
from hobson.errors import DataError, DigestMismatch
from hobson.io import iter_jsonl, sha256_file

MANIFEST = "MANIFEST.json"
FORMATS = ("qa-jsonl",)
EVAL_EVERY = 5  # about one state in five goes to eval

_PHRASINGS = ["Pick the correct option.", "Which option answers the question?", "Choose the right answer."]
_RAW_KEYS = {"question", "options", "answer", "context", "task"}


def manifest_sources(data_dir: Path, fmt: str) -> list[dict[str, Any]]:
    """Sources of format ``fmt`` listed in ``D/raw/MANIFEST.json`` (manifest order)."""
    path = data_dir / "raw" / MANIFEST
    if not path.is_file():
        return []
    manifest = json.loads(path.read_text(encoding="utf-8"))
    return [s for s in manifest.get("sources", []) if s.get("format") == fmt]


def check_source(data_dir: Path, source: dict[str, Any]) -> Path:
    path = data_dir / "raw" / source["name"]
    actual = sha256_file(path)
    if actual != source["sha256"]:
        raise DigestMismatch(
            f"{path}: sha256 mismatch: expected {source['sha256']} (from {data_dir / 'raw' / MANIFEST}), "
            f"actual {actual}"
        )
    return path


def _qa_row(obj: Any, path: Path, lineno: int, name: str) -> Row:
    where = f"{path}:{lineno}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - _RAW_KEYS)
    if unknown:
        allowed = ", ".join(sorted(_RAW_KEYS))
        raise DataError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {allowed})")
    q, opts, ans = obj.get("question"), obj.get("options"), obj.get("answer")
    if not isinstance(q, str) or not q.strip():
        raise DataError(f"{where}: question must be a non-empty string")
    if not (isinstance(opts, list) and opts and all(isinstance(o, str) for o in opts)):
        raise DataError(f"{where}: options must be a non-empty list of strings")
    if not (isinstance(ans, int) and not isinstance(ans, bool) and 0 <= ans < len(opts)):
        raise DataError(f"{where}: answer must be an option index in 0..{len(opts) - 1}, got {ans!r}")
    context = obj.get("context", "")
    state = f"{context}\n{q}" if context else q
    pick = int.from_bytes(hashlib.sha256(state.encode("utf-8")).digest()[:2], "big") % len(_PHRASINGS)
    return make_row("choice", state, _PHRASINGS[pick], [[o, ""] for o in opts], ans,
                    str(obj.get("task", f"raw:{name}")), _PHRASINGS[:pick] + _PHRASINGS[pick + 1 :])


def is_eval(row: Row) -> bool:
    return hashlib.sha256(row["state"].encode("utf-8")).digest()[0] % EVAL_EVERY == 0


def qa_rows(path: Path, name: str, split: str) -> Iterator[Row]:
    want_eval = split == "eval"
    for lineno, obj in iter_jsonl(path):
        row = _qa_row(obj, path, lineno, name)
        if is_eval(row) == want_eval:
            yield row
