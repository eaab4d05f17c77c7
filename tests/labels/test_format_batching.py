"""Prompt text, option-count limits, the batching plan and the pinned label-row bytes."""

from __future__ import annotations

import pytest

from hobson.errors import DataError
from hobson.labels import check_option_counts, format_label_line, plan_batches, render_prompt

ROW = {"kind": "choice", "state": "Box 1 holds 3 kg; box 2 holds 5 kg.", "instructions": "Which box is heavier?",
       "options": [["box 1", "3 kg"], ["box 2", ""]], "label": 1}


def test_prompt_letters_options_and_ends_with_answer_cue():
    assert render_prompt(ROW) == (
        "Box 1 holds 3 kg; box 2 holds 5 kg.\n\nWhich box is heavier?\n\n"
        "A. box 1: 3 kg\nB. box 2\nAnswer:"
    )


def test_more_than_26_options_is_refused_naming_file_and_line(tmp_path):
    rows = [ROW, dict(ROW, options=[[f"o{k}", ""] for k in range(27)], label=0)]
    with pytest.raises(DataError, match=r"^corpus\.jsonl:2: 27 options; .*at most 26"):
        check_option_counts(rows, "corpus.jsonl")


def test_label_line_bytes_are_pinned_to_six_decimals():
    assert format_label_line(12, [0.125, 0.875]) == '{"i": 12, "probs": [0.125000, 0.875000]}\n'
    with pytest.raises(ValueError, match="row 3"):
        format_label_line(3, [float("nan"), 1.0])


def test_batches_shortest_first_ties_by_index_under_both_budgets():
    lengths = [5, 3, 9, 3, 4, 12, 5, 5, 40]
    batches = plan_batches(lengths, max_batch_tokens=16, max_batch_rows=3)
    assert batches == [[1, 3, 4], [0, 6, 7], [2], [5], [8]]
    flat = [i for b in batches for i in b]
    assert flat == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 16
    assert plan_batches(lengths, 16, 3) == batches  # deterministic
    assert plan_batches(lengths, 1000, 100) == [flat]
