"""bench/weight_sync.py keeps working at tiny size: every path's row, and its JSON record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_weight_sync_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "ws.json"
    cmd = [sys.executable, "bench/weight_sync.py", "--size", "tiny", "--repeat", "1", "--dir", str(tmp_path),
           "--json", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {cells[1].strip(): cells[2:] for line in r.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| path", "| ---")) and (cells := line.split("|"))}
    assert set(rows) == {"shared-dir, remote (write + server load)", "dist, remote (stage + broadcast + commit)",
                         "limit: gloo broadcast of the bytes, remote", "dist, in-process (stage + hand-off + commit)",
                         "part: stage alone (export + digest)", "part: version digest alone (on the tensors' device)",
                         "part: engine build from the tensors (load + serve)",
                         "limit: in-memory copy of the bytes"}
    rec = json.loads(out.read_text())
    assert rec["bench"] == "weight_sync" and set(rec["weight_sync_s"]) == set(rows) and rec["bytes"] > 0
    assert all(t > 0 for t in rec["weight_sync_s"].values())
    assert all(float(v[0]) == round(rec["weight_sync_s"][k], 3) for k, v in rows.items())  # the table is the JSON
    assert [p.name for p in tmp_path.iterdir()] == ["ws.json"]  # the publications went with the temp dir
