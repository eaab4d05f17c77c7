"""The default corpus: byte-identical across processes, pinned by data/SHA256SUMS, well formed."""

from __future__ import annotations

import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from hobson.corpus import EXPECTED_ROWS, STAGE_OUTPUTS, read_rows, verify_corpus
from hobson.corpus.stages import GENERATOR_STAGES, run_catchall
from hobson.corpus.sums import committed_sums_path, read_sums
from hobson.errors import DigestMismatch
from hobson.io import sha256_file

STAGE_NAMES = list(GENERATOR_STAGES)


def _files(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


def _rows(d: Path, rel: str) -> list[dict]:
    return read_rows(d / rel)  # consistency/flip files: "pair" allowed by file name


def test_two_builds_in_separate_processes_are_byte_identical(two_builds: tuple[Path, Path]) -> None:
    a, b = two_builds
    fa, fb = _files(a), _files(b)
    assert fa == fb
    expected = {f"{s}/{n}" for s in STAGE_NAMES for n in ("SHA256SUMS", "SOURCE")}
    expected |= set(EXPECTED_ROWS) | {"raw/MANIFEST.json", "raw/SHA256SUMS"}
    assert set(fa) == expected


def test_default_corpus_matches_committed_sums(two_builds: tuple[Path, Path]) -> None:
    a, _ = two_builds
    committed = read_sums(committed_sums_path())
    assert set(committed) == set(EXPECTED_ROWS)
    for rel, digest in committed.items():
        assert sha256_file(a / rel) == digest, rel
    assert verify_corpus(a) == {**committed, "raw/MANIFEST.json": sha256_file(a / "raw/MANIFEST.json")}
    for stage in STAGE_NAMES:
        assert (a / stage / "SOURCE").read_text() == "generator seed=0 scale=1\n"


def test_row_counts_families_labels(two_builds: tuple[Path, Path]) -> None:
    a, _ = two_builds
    for stage, spec in GENERATOR_STAGES.items():
        for split in spec.splits:
            rel = f"{stage}/{split.name}.jsonl"
            rows = _rows(a, rel)  # validates every row, labels in range included
            assert len(rows) == EXPECTED_ROWS[rel]
            tasks = Counter(r["task"] for r in rows)
            assert sorted(tasks) == sorted(f.name for f in split.families), rel
            for r in rows:
                assert 0 <= r["label"] < len(r["options"])
                assert 2 <= len(r["instruction_variants"]) <= 3
                assert r["instructions"] not in r["instruction_variants"]
                assert len(r["state"]) <= 200
    build_tasks = {r["task"] for r in _rows(a, "build/train.jsonl")}
    assert len(build_tasks) >= 12
    kinds = {r["kind"] for s in STAGE_NAMES for r in _rows(a, f"{s}/train.jsonl")}
    assert kinds == {"noul", "choice", "score"}


def test_heldout_splits_disjoint_from_train(two_builds: tuple[Path, Path]) -> None:
    a, _ = two_builds
    for stage, spec in GENERATOR_STAGES.items():
        train = _rows(a, f"{stage}/train.jsonl")
        train_keys = {(r["state"], r["instructions"]) for r in train}
        train_states = {r["state"] for r in train}
        for split in spec.splits:
            if not split.heldout:
                continue
            for r in _rows(a, f"{stage}/{split.name}.jsonl"):
                assert (r["state"], r["instructions"]) not in train_keys
                assert r["state"] not in train_states


def test_paired_eval_sets(two_builds: tuple[Path, Path]) -> None:
    a, _ = two_builds
    for name, same_label in (("consistency", True), ("flip", False)):
        pairs: dict[int, list[dict]] = defaultdict(list)
        for r in _rows(a, f"generated/{name}.jsonl"):
            assert list(r)[-1] == "pair"
            pairs[r["pair"]].append(r)
        assert sorted(pairs) == list(range(len(pairs)))
        for p, (x, y) in ((p, rows) for p, rows in pairs.items()):
            assert x["state"] == y["state"] and x["options"] == y["options"], p
            assert x["instructions"] != y["instructions"], p
            assert (x["label"] == y["label"]) is same_label, p


def test_catchall_label_is_none_of_these(two_builds: tuple[Path, Path]) -> None:
    a, _ = two_builds
    for r in _rows(a, "catchall/train.jsonl"):
        assert r["options"][r["label"]][0] == "none of these"
        assert sum(o[0] == "none of these" for o in r["options"]) == 1


def test_flipped_byte_raises_digest_mismatch(two_builds: tuple[Path, Path], tmp_path: Path) -> None:
    d = tmp_path / "corpus"
    shutil.copytree(two_builds[0], d)
    rel = "multistep/eval.jsonl"
    data = bytearray((d / rel).read_bytes())
    data[100] ^= 0x01
    (d / rel).write_bytes(bytes(data))
    actual = sha256_file(d / rel)
    with pytest.raises(DigestMismatch) as exc:
        verify_corpus(d, [rel])
    msg = str(exc.value)
    assert str(d / rel) in msg and actual in msg and read_sums(committed_sums_path())[rel] in msg
    # Re-recording the stage SHA256SUMS does not hide it: the default is pinned by data/SHA256SUMS.
    sums = d / "multistep" / "SHA256SUMS"
    sums.write_text(sums.read_text().replace(read_sums(sums)[rel], actual))
    with pytest.raises(DigestMismatch, match=r"committed in .*data/SHA256SUMS"):
        verify_corpus(d, [rel])
    verify_corpus(d, ["multistep/train.jsonl"])  # the untouched file still passes


def test_generator_drift_fails_loudly_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    committed = read_sums(committed_sums_path())
    fake = tmp_path / "SHA256SUMS"
    fake.write_text("".join(f"{'0' * 64 if r == 'catchall/eval.jsonl' else d}  {r}\n" for r, d in committed.items()))
    monkeypatch.setattr("hobson.corpus.sums.committed_sums_path", lambda: fake)
    with pytest.raises(DigestMismatch, match=r"catchall/eval.jsonl: the default corpus drifted .*"
                                             r"python -m jobs.catchall --write-sums"):
        run_catchall(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d" / "catchall").iterdir()) == []


def test_scaled_build_counts_and_disjointness(tmp_path: Path, run_stage) -> None:
    proc = run_stage("catchall", tmp_path, "--scale", "3", "--seed", "7")
    assert proc.returncode == 0, proc.stderr
    assert "generator seed=7 scale=3" in proc.stderr
    assert (tmp_path / "catchall" / "SOURCE").read_text() == "generator seed=7 scale=3\n"
    train, ev = _rows(tmp_path, "catchall/train.jsonl"), _rows(tmp_path, "catchall/eval.jsonl")
    assert len(train) == 3 * EXPECTED_ROWS["catchall/train.jsonl"]
    assert len(ev) == 3 * EXPECTED_ROWS["catchall/eval.jsonl"]
    assert not {r["state"] for r in train} & {r["state"] for r in ev}
    verify_corpus(tmp_path, STAGE_OUTPUTS["catchall"])  # not the default: only the stage's own sums apply
    for line in proc.stdout.splitlines():
        assert line.split("\t")[1].endswith(" rows")


def test_write_sums_records_only_its_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from hobson.jobs.catchall import main

    committed = read_sums(committed_sums_path())
    target = tmp_path / "SHA256SUMS"
    target.write_text(f"{'1' * 64}  build/train.jsonl\n{'2' * 64}  catchall/train.jsonl\n")
    monkeypatch.setattr("hobson.corpus.sums.committed_sums_path", lambda: target)
    assert main(["--write-sums"]) == 0
    assert read_sums(target) == {
        "build/train.jsonl": "1" * 64,
        "catchall/eval.jsonl": committed["catchall/eval.jsonl"],
        "catchall/train.jsonl": committed["catchall/train.jsonl"],
    }
    assert f"updated {target}" in capsys.readouterr().out
    assert main(["--write-sums", "--scale", "2"]) == 2  # only the default corpus is ever recorded
