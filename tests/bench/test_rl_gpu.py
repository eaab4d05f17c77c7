"""bench/rl_gpu.py keeps working: its rollout and publication parts at tiny size on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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
    # the engine as it was before session 12 runs beside it (bench/rl_gpu.py's same-run baseline)
    assert set(engines) == {"native engine (CUDA graphs)", "native engine (CUDA graphs), before session 12",
                            "native engine (eager)", "plain HF-style generate"}
    # decode ms/step is (total - prefill) / (new - 1), two separately timed runs: at this size timing
    # noise can make it negative, so only its presence is checked here, not its sign
    assert all(e["tokens_per_s"] > 0 and math.isfinite(e["decode_ms_per_step"]) for e in engines.values())
    assert res["rollout"]["vs_reference"]["floor_ms"] == 22.0
    for name in ("native engine (CUDA graphs)", "plain HF-style generate"):  # --profile, host side on a CPU
        prof = res["rollout"]["profile"][name]
        assert prof["steps"] == 4 and prof["aten_ops_per_step"] > 0 and prof["top_host_ops"]
    assert "### profile: rollout, native engine (CUDA graphs)" in r.stdout
    pub = res["publish"]
    assert pub["bytes"] > 0 and pub["publish_s"] > 0 and pub["load_s"] > 0 and pub["raw_copy_s"] > 0
    assert "| publish (export, digest, manifest, fsync, rename) |" in r.stdout
