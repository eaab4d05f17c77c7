"""A bug reaches the user as one message naming the file that holds its traceback (exit 70), and
as the full traceback with HOBSON_DEBUG=1 (here the bug is a run record missing a key the code
assumes; what the launcher reads is real, nothing is patched)."""

import json
import re
from pathlib import Path


def _broken_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"backend": "local"}) + "\n")  # no run_id, created_utc, ...
    (run / "stages.jsonl").write_text("")
    return run


def test_internal_error_is_one_message_and_a_traceback_file(cli, tmp_path):
    proc = cli("status", str(_broken_run(tmp_path)), check=False)
    assert proc.returncode == 70
    assert "Traceback" not in proc.stderr
    m = re.search(r"submit.py: internal error: KeyError: .*\n  this is a bug in hobson, not in your input; the "
                  r"traceback is in (\S+)\n", proc.stderr)
    assert m, proc.stderr
    text = Path(m.group(1)).read_text()
    assert "Traceback (most recent call last)" in text and "KeyError" in text and "status" in text.splitlines()[0]
    Path(m.group(1)).unlink()


def test_hobson_debug_prints_the_traceback(cli, tmp_path):
    proc = cli("status", str(_broken_run(tmp_path)), check=False, env={"HOBSON_DEBUG": "1"})
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr and "KeyError" in proc.stderr
