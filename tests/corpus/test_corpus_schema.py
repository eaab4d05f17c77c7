"""Malformed corpus rows stop with ``file:line: what is wrong``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hobson.corpus import read_rows
from hobson.corpus.schema import NOUL_OPTIONS, make_row
from hobson.errors import DataError
from hobson.io import dumps_row

GOOD = make_row("noul", "n = 12", "Is n even?", NOUL_OPTIONS, 0, "divisibility", ["Is n divisible by 2?"])


def _with(**changes: object) -> str:
    row = dict(GOOD)
    row.update(changes)
    return dumps_row(row)


def _without(key: str) -> str:
    return dumps_row({k: v for k, v in GOOD.items() if k != key})


BAD_LINES = {
    "bad_json": ('{"kind": "noul", "state": ', r"not valid JSON"),
    "not_object": ("[1, 2]", r"row must be a JSON object"),
    "missing_field": (_without("label"), r"missing field\(s\) label"),
    "extra_field": (_with(lable=1), r"unknown field\(s\) lable"),
    "unknown_kind": (_with(kind="rank"), r"kind 'rank' is not one of noul, choice, score"),
    "state_type": (_with(state=5), r"field state must be a string, got int"),
    "label_type": (_with(label="0"), r"field label must be an integer, got str"),
    "label_bool": (_with(label=True), r"field label must be an integer, got bool"),
    "label_range": (_with(label=3), r"label 3 out of range for 3 options"),
    "label_negative": (_with(label=-1), r"label -1 out of range for 3 options"),
    "empty_options": (_with(options=[]), r"field options is empty"),
    "option_shape": (_with(options=[["yes"]]), r"options\[0\] must be \[name, description\]"),
    "variants_type": (_with(instruction_variants="x"), r"instruction_variants must be a list of strings"),
    "weight_type": (_with(weight="1"), r"field weight must be a non-negative number"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_row_names_file_line_and_problem(tmp_path: Path, case: str) -> None:
    line, pattern = BAD_LINES[case]
    path = tmp_path / "rows.jsonl"
    path.write_text(dumps_row(GOOD) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as exc:
        read_rows(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:2: "), msg
    assert re.search(pattern, msg), msg


def test_good_rows_and_pair_key(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    paired = dict(GOOD, pair=0)
    path.write_text(dumps_row(GOOD) + "\n" + dumps_row(paired) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r":2: unknown field\(s\) pair"):
        read_rows(path)
    rows = read_rows(path, extra_keys=("pair",))
    assert rows[1]["pair"] == 0 and list(rows[0]) == list(GOOD)
    assert json.loads(path.read_text().splitlines()[0]) == GOOD
