"""bench/serve.py keeps working: its table has the baseline and one row per client count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_serve_bench_small(calibrated: Path, decider_data, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "bench/serve.py", "--checkpoint", str(calibrated), "--rows", str(decider_data["val"]),
           "--questions", "16", "--clients", "1,4", "--threads", "1", "--json", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(c[0].strip(), c[1].strip()) for c in rows[1:]] == [
        ("one process, ask per question (baseline)", "1"), ("server, one question per request", "1"),
        ("server, one question per request", "4")]
    result = json.loads(out.read_text())
    assert set(result["server"]) == {"1", "4"} and result["server_stats"]["questions"] >= 32
    for v in result["server"].values():
        assert v["ratio"] == v["qps"] / result["baseline"]["qps"] and v["p50_ms"] <= v["p99_ms"]
