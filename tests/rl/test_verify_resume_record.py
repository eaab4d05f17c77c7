"""``verify-resume --record RUN_A > a.json`` then ``verify-resume a.json RUN_B``: a run compared
against a digest record of another gives every item the verdict the two runs give, and a single
changed byte is named (the item, and the tensor or row field that holds it).

One tiny Nanbeige PPO pair (DeepSpeed, CPU, fp32; actor, critic, optimizer, RNG): the full run
and ``--stop-after 2`` here, the ``--resume`` in a fresh process (tests/rl/resume_runs.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hobson import manifest
from hobson.launch.submit import main as submit
from hobson.rl.verify_resume import compare, compare_records, compare_runs, record_run
from tests.rl.resume_runs import COMMON, full_stop_resume


def _args(out: Path) -> list[str]:
    return ["--algorithm", "ppo", "--model", "tiny:nanbeige", "--output", str(out), *COMMON]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rl-record")
    full, part = root / "full", root / "part"
    full_stop_resume([(_args(full), _args(part))], timeout=600)
    return full, part


def _verdicts(items) -> list[tuple[str, bool]]:
    return [(i.name, i.difference is None) for i in items]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_record_against_run_gives_the_runs_verdicts(pair, tmp_path, capsys) -> None:
    full, part = pair
    runs = compare_runs(full, part)
    assert runs and all(i.difference is None for i in runs), [i.line() for i in runs if i.difference]
    names = " ".join(i.name for i in runs)
    assert "critic parameters" in names and "optimizer state" in names and "latent traces" in names

    # the launcher: --record to stdout, then the record against the run (exit 0, the same lines)
    assert submit(["verify-resume", "--record", str(full)]) == 0
    rec_text = capsys.readouterr().out
    record = tmp_path / "a.json"
    record.write_text(rec_text)
    rec = json.loads(rec_text)
    assert rec["run"] == str(full) and "3" in rec["checkpoints"]
    assert submit(["verify-resume", str(record), str(part)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:-1] == [i.line() for i in runs]
    assert out[-1] == f"{len(runs)} equal, 0 different"
    # the record holds digests, not the weights: the full run can go
    assert len(rec_text) < 2_000_000

    # one byte of the update-3 critic, manifest rewritten so the checkpoint still loads
    changed = tmp_path / "changed"
    shutil.copytree(part, changed)
    ck = changed / "checkpoints" / "update-000003"
    _flip_last_byte(ck / "critic.safetensors")
    fields = {k: v for k, v in manifest.read(ck).items() if k != "files"}
    manifest.write(ck, **fields)
    # one token of update 1's rollouts
    rollouts = changed / "rollouts" / "update-000001.jsonl"
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    rows[0]["tokens"][0] += 1
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    direct = compare_runs(full, changed)
    via_record = compare(record, changed)
    assert _verdicts(via_record) == _verdicts(direct)
    assert _verdicts(compare_records(rec, record_run(changed))) == _verdicts(direct)
    bad = {i.name: i.difference for i in direct if i.difference}
    assert set(bad) == {"checkpoint update-000003 critic parameters", "rollouts update-000001 tokens"}, bad
    named = {i.name: i.difference for i in via_record if i.difference}
    # the run-vs-run line names the element (critic.<tensor>[index]); the record's names the tensor
    tensor = bad["checkpoint update-000003 critic parameters"].split("[")[0]
    assert tensor.startswith("critic.")
    assert named["checkpoint update-000003 critic parameters"].startswith(f"{tensor}: "), named
    assert "bytes differ" in named["checkpoint update-000003 critic parameters"]
    assert named["rollouts update-000001 tokens"].startswith("row[0].tokens: "), named
    assert submit(["verify-resume", str(record), str(changed)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"{len(direct) - 2} equal, 2 different"
