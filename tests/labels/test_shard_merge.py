"""Sharded labelling merges to the one-process file byte for byte; the merge refuses bad shards."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from hobson.errors import DataError, DigestMismatch, StageError
from hobson.labels import label_rows, merge_shards
from hobson.labels.lm_scorer import LMOptionScorer
from hobson.labels.shardfile import write_shard
from hobson.shards import shard_paths
from tests.labels.labelkit import BATCH, sha


def label_all(rows, scorer, out, n, **kw) -> str:
    for s in range(n):
        label_rows(rows, scorer, out=str(out), shard=s, num_shards=n, **{**BATCH, **kw})
    return merge_shards(str(out), n).sha256


class WidthDependent:
    """The teacher plus a logit term that grows with the padded batch width.

    Stands in for kernels whose numerics depend on the batch shape: a row's output then depends on
    which rows share its batch, so only cutting whole batches can reproduce the one-process file.
    """

    def __init__(self, base: LMOptionScorer) -> None:
        self.base = base

    def lengths(self, rows):
        return self.base.lengths(rows)

    def score_batch(self, rows):
        width = max(self.base.lengths(rows))
        out = []
        for probs in self.base.score_batch(rows):
            logits = [math.log(p) + 0.05 * width * k for k, p in enumerate(probs)]
            z = max(logits)
            e = [math.exp(x - z) for x in logits]
            out.append([x / sum(e) for x in e])
        return out


class FailsAfter:
    """The teacher, interrupted by an exception after ``n`` batches (a crash mid-shard)."""

    def __init__(self, base, n: int) -> None:
        self.base, self.n = base, n

    def lengths(self, rows):
        return self.base.lengths(rows)

    def score_batch(self, rows):
        if self.n == 0:
            raise RuntimeError("injected failure")
        self.n -= 1
        return self.base.score_batch(rows)


def test_rows_are_six_decimal_probabilities_summing_to_one(reference, corpus_rows):
    lines = open(reference).read().splitlines()
    assert len(lines) == len(corpus_rows)
    for i, (line, row) in enumerate(zip(lines, corpus_rows, strict=True)):
        assert re.fullmatch(r'\{"i": ' + str(i) + r', "probs": \[\d\.\d{6}(, \d\.\d{6})*\]\}', line)
        probs = json.loads(line)["probs"]
        assert len(probs) == len(row["options"])
        assert abs(sum(probs) - 1) <= 1e-6 * len(probs)
    # A random teacher, but not a flat one: the test would prove little on uniform rows.
    assert len({line.split("[")[1] for line in lines}) == len(lines)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_merged_shards_equal_one_process_file(tmp_path, corpus_rows, scorer, reference, n):
    assert label_all(corpus_rows, scorer, tmp_path / "teacher.jsonl", n) == sha(reference)
    assert sha(tmp_path / "teacher.jsonl") == sha(reference)


def test_width_dependent_model_is_reproduced_by_whole_batch_sharding(tmp_path, corpus_rows, scorer, reference):
    wide = WidthDependent(scorer)
    one = label_all(corpus_rows, wide, tmp_path / "n1" / "t.jsonl", 1)
    assert one != sha(reference)  # the width term does change the bytes
    # Another batching changes the widths and so the bytes: the dependence is real ...
    assert label_all(corpus_rows, wide, tmp_path / "other" / "t.jsonl", 1, max_batch_tokens=300) != one
    # ... and yet every sharding reproduces the one-process file, because shards cut whole batches.
    for n in (2, 3, 4, 8):
        assert label_all(corpus_rows, wide, tmp_path / f"n{n}" / "t.jsonl", n) == one


def test_interrupted_shard_leaves_nothing_and_rerun_matches(tmp_path, corpus_rows, scorer, reference):
    out = str(tmp_path / "teacher.jsonl")
    path, done = shard_paths(out, 1, 3)
    with pytest.raises(RuntimeError, match="injected failure"):
        label_rows(corpus_rows, FailsAfter(scorer, 2), out=out, shard=1, num_shards=3, **BATCH)
    assert not os.path.exists(path) and not os.path.exists(done)
    assert os.listdir(tmp_path) == []  # no temp file left behind either
    for s in range(3):
        label_rows(corpus_rows, scorer, out=out, shard=s, num_shards=3, **BATCH)
    assert merge_shards(out, 3).sha256 == sha(reference)


def test_finished_shard_is_skipped_and_a_stale_one_relabelled(tmp_path, corpus_rows, scorer):
    out = str(tmp_path / "teacher.jsonl")
    first = label_rows(corpus_rows, scorer, out=out, shard=0, num_shards=2, **BATCH)
    again = label_rows(corpus_rows, FailsAfter(scorer, 0), out=out, shard=0, num_shards=2, **BATCH)
    assert again.skipped and again.sha256 == first.sha256
    path, _ = shard_paths(out, 0, 2)
    with open(path, "ab") as f:  # the file no longer matches its .done: label it again
        f.write(b'{"i": 999, "probs": [1.000000]}\n')
    redo = label_rows(corpus_rows, scorer, out=out, shard=0, num_shards=2, **BATCH)
    assert not redo.skipped and sha(path) == first.sha256


@pytest.fixture
def three_shards(tmp_path, corpus_rows, scorer):
    out = str(tmp_path / "teacher.jsonl")
    for s in range(3):
        label_rows(corpus_rows, scorer, out=out, shard=s, num_shards=3, **BATCH)
    return out


def _refused(out, n, exc, pattern, **kw):
    with pytest.raises(exc, match=pattern):
        merge_shards(out, n, **kw)
    assert not os.path.exists(out)
    assert not [f for f in os.listdir(os.path.dirname(out)) if f.endswith(".tmp")]


def test_merge_refuses_missing_shard(three_shards):
    path, done = shard_paths(three_shards, 2, 3)
    os.unlink(path)
    _refused(three_shards, 3, StageError, re.escape(path) + ": missing shard file")


def test_merge_refuses_shard_without_done(three_shards):
    path, done = shard_paths(three_shards, 1, 3)
    os.unlink(done)
    _refused(three_shards, 3, StageError, re.escape(path) + ": unfinished shard: no .*\\.done marker")


def test_merge_refuses_digest_mismatch(three_shards):
    path, _ = shard_paths(three_shards, 0, 3)
    data = bytearray(open(path, "rb").read())
    data[20] = ord("9") if data[20] != ord("9") else ord("8")  # one digit of a probability
    open(path, "wb").write(bytes(data))
    _refused(three_shards, 3, DigestMismatch, re.escape(path) + ": sha256 [0-9a-f]{64} differs from")


def test_merge_refuses_overlapping_indices(three_shards):
    p0, d0 = shard_paths(three_shards, 0, 3)
    p1, _ = shard_paths(three_shards, 1, 3)
    lines0 = open(p0).readlines()
    lines1 = open(p1).readlines()
    # A well-formed shard (valid .done) that also claims one of shard 1's rows.
    write_shard(p0, d0, sorted(lines0 + lines1[:1], key=lambda s: int(s[6:s.index(",")])))
    i = int(lines1[0][6:lines1[0].index(",")])
    _refused(three_shards, 3, StageError,
             f"overlapping shards: row index {i} is in {re.escape(p0)} and {re.escape(p1)}")


def test_merge_refuses_gaps_and_wrong_row_count(three_shards, corpus_rows):
    n = len(corpus_rows)
    _refused(three_shards, 3, StageError, f"hold {n} rows, expected {n + 1}: rows {n}..{n} are missing",
             expected_rows=n + 1)
    p2, d2 = shard_paths(three_shards, 2, 3)
    lines = open(p2).readlines()
    write_shard(p2, d2, lines[1:])  # a well-formed shard that lost its first row
    missing = int(lines[0][6:lines[0].index(",")])
    _refused(three_shards, 3, StageError, f"gap: no shard holds row index {missing}; .*shard.of3.jsonl holds")


def test_merge_refuses_a_malformed_line_naming_file_and_line(three_shards):
    p1, d1 = shard_paths(three_shards, 1, 3)
    lines = open(p1).readlines()
    lines[3] = lines[3].replace('{"i": ', '{"i":')
    write_shard(p1, d1, lines)
    _refused(three_shards, 3, DataError, re.escape(p1) + ":4: line does not start with")


def test_shift_by_offsets_indices_in_the_train_copy_only(three_shards, reference, tmp_path):
    before = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    before[0].write_text("x\n" * 7)
    before[1].write_text("y\n" * 993)
    res = merge_shards(three_shards, 3, shift_by=[str(p) for p in before], expected_rows=60)
    assert res.shift == 1000 and res.train_out == str(tmp_path / "teacher_train.jsonl")
    assert sha(three_shards) == sha(reference)
    plain = open(three_shards).read().splitlines()
    shifted = open(res.train_out).read().splitlines()
    assert sha(res.train_out) == res.train_sha256
    for k, (a, b) in enumerate(zip(plain, shifted, strict=True)):
        assert b == a.replace(f'{{"i": {k}, ', f'{{"i": {k + 1000}, ', 1)
