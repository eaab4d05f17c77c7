"""`recipe build multistep teacher --ngpu 4` end to end on the local backend, then status and verify."""

import json

import pytest

from hobson.io import sha256_file


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.conftest import run_cli

    base = tmp_path_factory.mktemp("recipe")
    run_dir = base / "run"
    proc = run_cli("recipe", "build", "multistep", "teacher", "--ngpu", "4", "--backend", "local",
                   "--run-dir", str(run_dir), "--logs-dir", str(base / "logs"))
    return run_dir, base / "logs" / "run", proc.stdout


def test_runs_every_stage_and_prints_where_things_are(run):
    run_dir, logs, out = run
    assert "[teacher] 4 tasks done" in out and "[teacher-merge] ok" in out
    assert f"output : {run_dir}/labels/teacher.jsonl" in out
    for name in ("build", "multistep", "teacher_0", "teacher_3", "teacher-merge"):
        assert (logs / f"{name}.log").exists()
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["backend"] == "local" and meta["git"]["revision"] and meta["versions"]["torch"]
    assert set(meta["config_digests"]) and "teacher" in meta["command"]


def test_record_has_rows_and_digests_per_stage(run):
    run_dir, _, _ = run
    recs = [json.loads(line) for line in (run_dir / "stages.jsonl").read_text().splitlines()]
    by = {(r["stage"], r["shard"]): r for r in recs}
    assert sorted(k for k in by if k[0] == "teacher") == [("teacher", s) for s in range(4)]
    merge = by[("teacher-merge", None)]["outputs"]
    assert merge[0]["path"] == "labels/teacher.jsonl" and merge[0]["rows"] == merge[0]["expected_rows"] == 1200
    assert merge[0]["sha256"] == sha256_file(run_dir / "labels/teacher.jsonl") and merge[0]["ok"]
    assert all(r["status"] == "ok" and r["exit_code"] == 0 and r["wall_s"] > 0 for r in recs)
    assert all(r["gpus"] == 1 for r in recs if r["stage"] == "teacher")
    shards = [by[("teacher", s)]["outputs"][0]["rows"] for s in range(4)]
    assert sum(shards) == 1200


def test_status_shows_state_wall_rows_and_sha(cli, run):
    run_dir, _, _ = run
    out = cli("status", str(run_dir)).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("teacher-merge"))
    digest = sha256_file(run_dir / "labels/teacher.jsonl")[:12]
    assert " ok " in line and " 1200 " in line and digest in line
    assert sum(1 for ln in out.splitlines() if ln.startswith("teacher ")) == 4


def test_rerun_skips_finished_stages(cli, run, tmp_path):
    run_dir, _, _ = run
    out = cli("recipe", "build", "multistep", "teacher", "--ngpu", "4", "--backend", "local",
              "--run-dir", str(run_dir), "--logs-dir", str(tmp_path)).stdout
    assert out.count("already done with matching digests: skipped") == 4


def test_verify_passes_then_names_a_changed_file(cli, run):
    run_dir, _, _ = run
    assert "16/16 outputs match" in cli("verify", str(run_dir)).stdout
    target = run_dir / "labels/teacher.jsonl"
    data = bytearray(target.read_bytes())
    data[100] ^= 1
    original = target.read_bytes()
    target.write_bytes(bytes(data))
    try:
        proc = cli("verify", str(run_dir), check=False)
        assert proc.returncode == 1
        assert "CHANGED  labels/teacher.jsonl (stage teacher-merge)" in proc.stdout
    finally:
        target.write_bytes(original)


def test_stage_whose_input_changed_is_refused_naming_it(cli, run):
    run_dir, _, _ = run
    corpus = run_dir / "data/multistep/train.jsonl"
    original = corpus.read_bytes()
    corpus.write_bytes(original.replace(b"fastest", b"fastesT", 1))
    try:
        proc = cli("recipe", "teacher", "--backend", "local", "--run-dir", str(run_dir), check=False)
        assert proc.returncode == 2
        assert "teacher: needs data/multistep/train.jsonl" in proc.stderr and "differs from its record" in proc.stderr
    finally:
        corpus.write_bytes(original)
