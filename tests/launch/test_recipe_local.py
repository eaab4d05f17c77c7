"""`recipe all --ngpu 2` end to end on the local backend, then status, verify, rerun and refusals."""

import json

import pytest

from hobson.io import sha256_file
from hobson.launch.dag import ALL


@pytest.mark.slow
def test_runs_every_stage_and_prints_the_evaluation(recipe_all_local):
    """Slow: its session fixture runs the whole recipe on the local backend once (the other tests reuse it)."""
    run_dir, logs, out = recipe_all_local
    assert "[teacher] 2 tasks done" in out and "[replay] 2 tasks done" in out
    assert "## Overall" in out and f"report : {run_dir}/eval/report.md" in out
    for name in ("build", "multistep", "teacher_0", "teacher_1", "teacher-merge", "parent", "replay_1", "train",
                 "calibrate", "eval"):
        assert (logs / f"{name}.log").exists(), name
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["backend"] == "local" and meta["git"]["revision"] and meta["versions"]["torch"]
    assert set(meta["config_digests"]) and "all" in meta["command"]


def test_record_lists_every_stage_with_rows_and_digests(recipe_all_local):
    run_dir, _, _ = recipe_all_local
    recs = [json.loads(line) for line in (run_dir / "stages.jsonl").read_text().splitlines()]
    by = {(r["stage"], r["shard"]): r for r in recs}
    stages = {r["stage"] for r in recs}
    assert stages == set(ALL) | {"teacher-merge", "replay-merge"}
    assert all(r["status"] == "ok" and r["exit_code"] == 0 and r["wall_s"] > 0 for r in recs)
    for r in recs:
        for o in r["outputs"]:
            assert o["ok"] and o["sha256"] == sha256_file(run_dir / o["path"]), o["path"]
    for merge in ("teacher-merge", "replay-merge"):
        out = by[(merge, None)]["outputs"][0]
        assert out["rows"] == out["expected_rows"] == 1200
    assert sorted(k for k in by if k[0] == "teacher") == [("teacher", 0), ("teacher", 1)]
    assert by[("train", None)]["gpus"] == 2 and by[("train", None)]["world_size"] == 2
    assert by[("parent", None)]["world_size"] == 2


def test_final_model_beats_the_majority_baseline(recipe_all_local):
    run_dir, _, _ = recipe_all_local
    overall = json.loads((run_dir / "eval/report.json").read_text())["overall"]
    assert overall["rows"] >= 1000
    assert overall["accuracy"] > overall["majority_accuracy"]
    assert overall["p_beats_majority"] < 0.01
    assert (run_dir / "eval/reliability.png").stat().st_size > 1000


def test_status_shows_state_wall_rows_and_sha(cli, recipe_all_local):
    run_dir, _, _ = recipe_all_local
    out = cli("status", str(run_dir)).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("teacher-merge"))
    digest = sha256_file(run_dir / "labels/teacher.jsonl")[:12]
    assert " ok " in line and " 1200 " in line and digest in line
    assert sum(1 for ln in out.splitlines() if ln.startswith("replay ")) == 2


def test_rerun_skips_finished_stages(cli, recipe_all_local, tmp_path):
    run_dir, _, _ = recipe_all_local
    out = cli("recipe", "all", "--ngpu", "2", "--backend", "local", "--run-dir", str(run_dir),
              "--logs-dir", str(tmp_path)).stdout
    assert out.count("already done with matching digests: skipped") == 15


def test_verify_passes_then_names_a_changed_file(cli, recipe_all_local):
    run_dir, _, _ = recipe_all_local
    assert "outputs match their record" in cli("verify", str(run_dir)).stdout
    target = run_dir / "labels/teacher.jsonl"
    original = target.read_bytes()
    data = bytearray(original)
    data[100] ^= 1
    target.write_bytes(bytes(data))
    try:
        proc = cli("verify", str(run_dir), check=False)
        assert proc.returncode == 1
        assert "CHANGED  labels/teacher.jsonl (stage teacher-merge)" in proc.stdout
    finally:
        target.write_bytes(original)


def test_verify_rehashes_the_decider_checkpoints(cli, recipe_all_local):
    """Trained, souped and calibrated checkpoints carry manifests; verify re-hashes each one."""
    run_dir, _, _ = recipe_all_local
    out = cli("verify", str(run_dir), "--verbose").stdout
    ok = [line for line in out.splitlines() if line.startswith("ok ") and "manifest" not in line]
    assert "decider checkpoints match their manifests" in out, out
    heads = sorted(run_dir.rglob("head.safetensors"))
    assert heads and all(f"ok       {h.parent.relative_to(run_dir)}" in ok for h in heads), out
    target = heads[-1]
    original = target.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    try:
        proc = cli("verify", str(run_dir), check=False)
        assert proc.returncode == 1
        assert f"CORRUPT  {target.parent.relative_to(run_dir)}: {target}: sha256" in proc.stdout, proc.stdout
    finally:
        target.write_bytes(original)


def test_stage_whose_input_changed_is_refused_naming_it(cli, recipe_all_local):
    run_dir, _, _ = recipe_all_local
    corpus = run_dir / "data/multistep/train.jsonl"
    original = corpus.read_bytes()
    corpus.write_bytes(original.replace(b"fastest", b"fastesT", 1))
    try:
        proc = cli("recipe", "teacher", "--backend", "local", "--run-dir", str(run_dir), check=False)
        assert proc.returncode == 2
        assert "teacher: needs data/multistep/train.jsonl" in proc.stderr and "differs from its record" in proc.stderr
    finally:
        corpus.write_bytes(original)
