"""bench/checkpoint.py keeps working at tiny size, and its table shows what the new write saves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_bench_tiny(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/checkpoint.py", "--size", "tiny", "--critic", "--repeat", "1",
           "--dir", str(tmp_path / "w"), "--json", str(tmp_path / "r.json")]
    (tmp_path / "w").mkdir()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith("load (verify"))
    rows = {line[:44].strip(): line[44:].split() for line in lines[2:cut]}
    loads = {line[:44].strip(): line[44:].split() for line in lines[cut + 1:]}
    assert set(loads) == {"load before: serial sha256 + torch.load", "load now: chunked verify + safetensors"}
    assert all(float(v[1]) > 0 for v in loads.values())
    assert set(rows) == {"plain: save_file + torch.save (CRC-32)", "before: + no CRC-32, serial sha256",
                         "now: threaded tensorfile, chunked sha256", "background: the update waits (capture)",
                         "background: capture + write in a thread", "raw copy + fsync of the plain bytes"}
    # the wait is part of the whole background write
    assert 0 < float(rows["background: the update waits (capture)"][1]) <= float(
        rows["background: capture + write in a thread"][1])
    # every row wrote the same content: sizes within the headers', pickles' and manifests' few kB
    sizes = [float(r[0]) for r in rows.values()]
    assert max(sizes) - min(sizes) < 0.1 * max(sizes), rows
    assert list((tmp_path / "w").iterdir()) == []  # every output removed
    result = json.loads((tmp_path / "r.json").read_text())
    assert [r.get("write") or r["load"] for r in result["rows"]] == [*rows, *loads]
