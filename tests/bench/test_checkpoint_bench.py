"""bench/checkpoint.py keeps working at tiny size, and its table shows what the new write saves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_bench_tiny(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/checkpoint.py", "--size", "tiny", "--repeat", "1", "--dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line[:44].strip(): line[44:].split() for line in r.stdout.splitlines()[2:]}
    assert set(rows) == {"plain: actor file + torch.save (CRC-32)", "now: actor in publication, no CRC-32",
                         "background: the update waits (capture)", "background: capture + write in a thread",
                         "raw copy + fsync of the plain bytes"}
    # the wait is part of the whole background write
    assert 0 < float(rows["background: the update waits (capture)"][1]) <= float(
        rows["background: capture + write in a thread"][1])
    plain_mb, now_mb = float(rows["plain: actor file + torch.save (CRC-32)"][0]), float(
        rows["now: actor in publication, no CRC-32"][0])
    assert 0 < now_mb < plain_mb  # the actor's bytes are not written again
    assert list(tmp_path.iterdir()) == []  # every output removed
