"""The teacher and merge jobs as a user runs them: separate processes, one per array task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hobson.errors import ConfigError
from hobson.jobs import teacher as teacher_job
from hobson.jobs import teacher_merge
from hobson.labels import label_rows, render_prompt
from hobson.tinymodel import MODEL_CARD, ensure_default_teacher, texts_sha256
from tests.labels.labelkit import BATCH, sha, write_corpus

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--max-batch-tokens", str(BATCH["max_batch_tokens"]), "--max-batch-rows", str(BATCH["max_batch_rows"]),
         "--threads", "1"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env.pop("HOBSON_ARRAY_TASK", None)
    env.update(extra)
    return env


def test_array_tasks_in_separate_processes_merge_to_the_one_process_file(tmp_path, corpus_file, reference,
                                                                         teacher, corpus_rows, scorer):
    out = tmp_path / "run" / "teacher.jsonl"
    # A retry-style array: tasks 0 and 1 run shards 1 and 3 of 4 (shards[k]); shards 0 and 2 are
    # labelled here, in this process, with its own copy of the default teacher.
    cmd = [sys.executable, "-m", "jobs.teacher", "--corpus", corpus_file, "--out", str(out),
           "--num-shards", "4", "--shards", "1,3", *FLAGS]
    # Both tasks race to build the default teacher in <out dir>/models/teacher.
    procs = [subprocess.Popen(cmd, cwd=REPO, env=_env(HOBSON_ARRAY_TASK=str(k)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in range(2)]
    for s in (0, 2):
        label_rows(corpus_rows, scorer, out=str(out), shard=s, num_shards=4, **BATCH)
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    for k, log in zip((1, 3), logs, strict=True):
        assert f"teacher: shard {k} of 4: wrote {out.parent}/teacher.shard{k}of4.jsonl" in log
    assert not out.exists()
    merged = subprocess.run([sys.executable, "-m", "jobs.teacher_merge", "--out", str(out), "--num-shards", "4",
                             "--expected-rows", str(len(corpus_rows))],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    assert f"wrote {out} ({len(corpus_rows)} rows from 4 shards" in merged.stdout
    assert sha(out) == sha(reference)

    # The default teacher built by another process holds the same bytes as this process's.
    built, here = out.parent / "models" / "teacher", teacher[0]
    for name in ("model.safetensors", "tokenizer.json", "config.json", MODEL_CARD):
        assert sha(built / name) == sha(here / name), name
    card = json.loads((built / MODEL_CARD).read_text())
    assert card["seed"] == 0
    assert card["texts_sha256"] == texts_sha256([render_prompt(r) for r in corpus_rows])
    assert not [p for p in built.parent.iterdir() if p.name != "teacher"]  # losers' temp dirs removed


def test_one_shard_run_writes_the_output_and_a_rerun_skips(tmp_path, corpus_file, reference, teacher, capsys):
    out = tmp_path / "teacher.jsonl"
    argv = ["--corpus", corpus_file, "--out", str(out), "--teacher", str(teacher[0]), *FLAGS]
    assert teacher_job.main(argv) == 0
    assert sha(out) == sha(reference)
    assert teacher_job.main(argv) == 0
    assert "shard 0 of 1 already done" in capsys.readouterr().out
    assert sha(out) == sha(reference)


def test_too_many_options_stops_before_any_model_is_built(tmp_path, corpus_rows, capsys):
    rows = list(corpus_rows[:3]) + [dict(corpus_rows[3], options=[[f"o{k}", ""] for k in range(27)], label=0)]
    corpus = write_corpus(tmp_path / "c.jsonl", rows)
    out = tmp_path / "run" / "teacher.jsonl"
    assert teacher_job.main(["--corpus", corpus, "--out", str(out)]) == 1
    assert f"{corpus}:4: 27 options" in capsys.readouterr().err
    assert not out.parent.exists()


ROW = {"kind": "choice", "state": "s", "instructions": "Pick one.", "options": [["a", ""], ["b", ""]], "label": 1,
       "task": "t", "weight": 1.0, "instruction_variants": []}


@pytest.mark.parametrize("bad, message", [
    ("not json", ":2: not valid JSON"),
    (json.dumps(dict(ROW, label=2)), ":2: label 2 out of range for 2 options"),
    (json.dumps(dict(ROW, options=[])), ":2: field options is empty"),
    (json.dumps({k: v for k, v in ROW.items() if k != "state"}), ":2: missing field(s) state"),
])
def test_malformed_corpus_row_stops_the_stage_naming_file_and_line(tmp_path, capsys, bad, message):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps(ROW) + "\n" + bad + "\n")
    out = tmp_path / "run" / "teacher.jsonl"
    assert teacher_job.main(["--corpus", str(corpus), "--out", str(out)]) == 1
    assert f"{corpus}{message}" in capsys.readouterr().err
    assert not out.parent.exists()


def test_flipped_corpus_byte_stops_the_stage_naming_the_mismatch(tmp_path, corpus_rows, capsys):
    stage = tmp_path / "data" / "multistep"
    stage.mkdir(parents=True)
    corpus = write_corpus(stage / "train.jsonl", corpus_rows[:5])
    (stage / "SHA256SUMS").write_text(f"{sha(corpus)}  multistep/train.jsonl\n")
    data = bytearray(open(corpus, "rb").read())
    data[30] ^= 1
    open(corpus, "wb").write(bytes(data))
    out = tmp_path / "run" / "teacher.jsonl"
    assert teacher_job.main(["--corpus", corpus, "--out", str(out)]) == 1
    assert f"{corpus}: sha256 mismatch" in capsys.readouterr().err
    assert not out.parent.exists()


def test_merge_cli_names_the_missing_shard(tmp_path, capsys):
    out = tmp_path / "teacher.jsonl"
    assert teacher_merge.main(["--out", str(out), "--num-shards", "2"]) == 1
    assert f"{tmp_path}/teacher.shard0of2.jsonl: missing shard file" in capsys.readouterr().err
    assert not out.exists()


def test_default_teacher_dir_built_from_other_texts_is_refused(teacher):
    with pytest.raises(ConfigError, match="exists but is not the default teacher for these texts"):
        ensure_default_teacher(teacher[0], ["some other corpus"])


def test_help_explains_every_flag(capsys):
    for job in (teacher_job, teacher_merge):
        with pytest.raises(SystemExit) as e:
            job.main(["--help"])
        assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--corpus", "--teacher", "--default-teacher-dir", "--num-shards", "--shards", "--task-index",
                 "--max-batch-tokens", "--max-batch-rows", "--threads", "--device", "--shift-by",
                 "--expected-rows"):
        assert flag in text
