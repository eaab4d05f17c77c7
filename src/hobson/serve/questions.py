"""A ``/v1/decide`` body -> corpus rows, or one :class:`RequestError` naming the field.

A body is one question or ``{"questions": [question, ...]}``; a question is a corpus row's
asking part, ``{"state", "instructions", "options": [[name, description], ...], "kind"}``
(``state`` may be empty, ``kind`` defaults to ``choice``). Nothing else is accepted, so a typo
in a field name is an error rather than a silently ignored key.
"""

from __future__ import annotations

import json
from typing import Any

from hobson.corpus.schema import KINDS

QUESTION_FIELDS = ("state", "instructions", "options", "kind")
REQUIRED = ("instructions", "options")


class RequestError(ValueError):
    """A bad request: ``field`` names where (``questions[2].options[1]``), ``str()`` says what."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def parse_body(body: bytes, max_questions: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows a request body asks about (label 0 is a placeholder: asking needs no gold answer),
    and where each came from (``questions[i]``, or ``""`` for a body that is one question)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError("body", f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError("body", f"must be a JSON object, got {type(data).__name__}")
    if "questions" in data:
        extra = sorted(set(data) - {"questions"})
        if extra:
            raise RequestError(extra[0], "unknown field beside questions (send questions alone)")
        questions = data["questions"]
        if not isinstance(questions, list) or not questions:
            raise RequestError("questions", "must be a non-empty list of questions")
        prefix = "questions"
    else:
        questions, prefix = [data], None
    if len(questions) > max_questions:
        raise RequestError("questions", f"{len(questions)} questions, more than the server's limit of "
                                        f"{max_questions} per request; split them over several requests")
    where = [f"{prefix}[{i}]" if prefix else "" for i in range(len(questions))]
    return [_row(q, w) for q, w in zip(questions, where, strict=True)], where


def _row(q: Any, where: str) -> dict[str, Any]:
    def name(key: str) -> str:
        return f"{where}.{key}" if where else key

    if not isinstance(q, dict):
        raise RequestError(where or "body", f"a question must be a JSON object, got {type(q).__name__}")
    for key in q:
        if key not in QUESTION_FIELDS:
            raise RequestError(name(key), f"unknown field (a question has {', '.join(QUESTION_FIELDS)})")
    for key in REQUIRED:
        if key not in q:
            raise RequestError(name(key), "missing")
    state, instructions, kind = q.get("state", ""), q["instructions"], q.get("kind", "choice")
    for key, value in (("state", state), ("instructions", instructions), ("kind", kind)):
        if not isinstance(value, str):
            raise RequestError(name(key), f"must be a string, got {type(value).__name__}")
    if not instructions.strip():
        raise RequestError(name("instructions"), "is empty")
    if kind not in KINDS:
        raise RequestError(name("kind"), f"{kind!r} is not one of {', '.join(KINDS)}")
    options = q["options"]
    if not isinstance(options, list):
        raise RequestError(name("options"), f"must be a list of [name, description] pairs, "
                                            f"got {type(options).__name__}")
    if len(options) < 2:
        raise RequestError(name("options"), f"{len(options)} option(s): give at least two")
    for j, opt in enumerate(options):
        if not (isinstance(opt, list) and len(opt) == 2 and all(isinstance(s, str) for s in opt)):
            raise RequestError(f"{name('options')}[{j}]", f"must be [name, description] strings, got {opt!r}")
        if not opt[0].strip():
            raise RequestError(f"{name('options')}[{j}]", "the option's name is empty")
    return {"kind": kind, "state": state, "instructions": instructions, "options": [list(o) for o in options],
            "label": 0, "task": "serve", "weight": 1.0, "instruction_variants": []}
