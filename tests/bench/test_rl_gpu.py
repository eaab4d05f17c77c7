"""bench/rl_gpu.py keeps working: its rollout and publication parts at tiny size on CPU, and an e2e
resume pair split over three calls."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_rollout_and_publish_parts_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "rl_gpu.json"
    cmd = [sys.executable, "bench/rl_gpu.py", "--kind", "huginn_raven", "--size", "tiny", "--device", "cpu",
           "--engine-device", "cpu", "--parts", "rollout,publish", "--batch", "2", "--prompt-tokens", "8",
           "--new-tokens", "4", "--profile", "--work", str(tmp_path / "work"), "--json", str(out)]
    env = dict(os.environ)
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "rollout_error" not in res and "publish_error" not in res, res
    engines = res["rollout"]["engines"]
    # the engine as it was before session 12 and before session 25 (the decode graph captured in
    # every generate, SDPA attention), and with the kept graph but SDPA, beside it (same-run baselines)
    assert set(engines) == {"native engine (CUDA graphs)", "native engine (CUDA graphs), before session 12",
                            "native engine (CUDA graphs), before session 25",
                            "native engine (CUDA graphs), kept graph, SDPA attention",
                            "native engine (eager)", "plain HF-style generate"}
    # decode ms/step is (total - prefill) / (new - 1), two separately timed runs: at this size timing
    # noise can make it (and the ratios of it) negative, so only their presence is checked, not signs
    assert math.isfinite(res["rollout"]["vs_before_session_25"]) and math.isfinite(res["rollout"]["vs_sdpa_attention"])
    assert all(e["tokens_per_s"] > 0 and math.isfinite(e["decode_ms_per_step"]) for e in engines.values())
    assert res["rollout"]["vs_reference"]["floor_ms"] is None  # measured on a GPU at the official size only
    for name in ("native engine (CUDA graphs)", "plain HF-style generate"):  # --profile, host side on a CPU
        prof = res["rollout"]["profile"][name]
        assert prof["steps"] == 4 and prof["aten_ops_per_step"] > 0 and prof["top_host_ops"]
    assert "### profile: rollout, native engine (CUDA graphs)" in r.stdout
    pub = res["publish"]
    assert pub["bytes"] > 0 and pub["publish_s"] > 0 and pub["load_s"] > 0 and pub["raw_copy_s"] > 0
    assert "| publish (export, digest, manifest, fsync, rename) |" in r.stdout


@pytest.mark.slow
def test_one_resume_pair_spans_three_calls_via_the_record(tmp_path: Path) -> None:
    """Slow (~60 s on 2 cores: three tiny PPO runs of 3 updates with DeepSpeed on CPU, a record
    and a compare). A Huginn pair with a critic does not fit one 10-minute call of the GPU host,
    so ``--e2e-steps`` splits it: full+record, then stop, then resume+compare, each call finding
    what the one before left in --work; the verdict is that of one call doing everything."""
    work = tmp_path / "work"
    base = [sys.executable, "bench/rl_gpu.py", "--kind", "nanbeige", "--size", "tiny", "--device", "cpu",
            "--engine-device", "cpu", "--parts", "e2e", "--algorithms", "ppo", "--resume-algorithms", "ppo",
            "--via-record", "--work", str(work), "--shm", str(tmp_path / "shm" / "e2e"), "--shm-min-gb", "0"]
    (tmp_path / "shm").mkdir()  # a RAM-disk stand-in: the runs go there
    results = []
    for k, steps in enumerate(("full,record", "stop", "resume,compare")):
        out = tmp_path / f"call{k}.json"
        r = subprocess.run([*base, "--e2e-steps", steps, "--json", str(out)], cwd=REPO, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(json.loads(out.read_text())["e2e"]["ppo"])
        run_there = (tmp_path / "shm" / "e2e" / "ppo-a" / "run.json").exists()
        # after the record the full run is gone; the stopped run then takes its place until the compare
        assert run_there == (k == 1), (k, steps)
    full, stop, last = results
    assert full["rc_full"] == 0 and full["record_rc"] == 0 and len(full["updates"]) == 3
    assert (work / "e2e" / "ppo-a.record.json").stat().st_size > 1000
    assert stop["rc_stop"] == 0 and "rc_full" not in stop
    assert last["rc_resume"] == 0 and last["verify_resume_equal"] is True, last
    assert any("equal" in line for line in last["verify_resume"]), last["verify_resume"]
    assert not (tmp_path / "shm" / "e2e" / "ppo-a").exists(), "the pair's runs are removed once compared"
    assert (work / "e2e" / "ppo.run-dir").read_text() == str(tmp_path / "shm" / "e2e" / "ppo-a")
