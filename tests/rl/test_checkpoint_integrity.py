"""RL checkpoints carry a manifest of per-file SHA-256 digests and are verified when loaded: a resume
whose newest checkpoint is corrupt or incomplete sets it aside (``*.corrupt``), records why, resumes
from the newest intact one and still ends with the uninterrupted run's bits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hobson.jobs.rl import main
from hobson.rl import checkpoint as ckpt
from hobson.rl.verify_resume import compare_runs

ARGS = ["--algorithm", "ppo", "--model", "tiny:nanbeige", "--reward", "test-token-value", "--max-new-tokens", "4",
        "--prompts-per-update", "2", "--updates", "3", "--lr", "1.0", "--device", "cpu", "--trainer", "torch"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("integrity")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*ARGS, "--output", str(root / "full")]) == 0
        assert main([*ARGS, "--output", str(root / "part"), "--stop-after", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    return root / "full", root / "part"


def _flip(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _copy(part: Path, run: Path) -> None:
    """A copy of the stopped run under another name (the record's output follows it)."""
    shutil.copytree(part, run)
    meta = json.loads((run / "run.json").read_text())
    meta["rl"]["settings"]["output"] = str(run)
    (run / "run.json").write_text(json.dumps(meta))


def _resume(run: Path) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main([*ARGS, "--output", str(run), "--resume"])
    finally:
        torch.set_num_threads(threads)


def test_every_checkpoint_has_a_manifest_of_its_files(runs: tuple[Path, Path]) -> None:
    d = ckpt.checkpoint_dir(runs[0], 2)
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in d.iterdir()} - {ckpt.MANIFEST}
    assert {"state.pt", "critic.safetensors"} <= set(manifest["files"])
    assert ckpt.verify_checkpoint(d) == []


@pytest.mark.parametrize("damage", ["critic.safetensors", "state.pt", "state.safetensors", "publication", "no manifest",
                                    "truncated"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_result_is_unchanged(
        runs: tuple[Path, Path], tmp_path: Path, damage: str, capsys: pytest.CaptureFixture) -> None:
    full, part = runs
    run = tmp_path / "run"
    _copy(part, run)
    d = ckpt.checkpoint_dir(run, 2)
    if damage == "publication":  # the checkpoint reads its actor from publication v2
        _flip(run / "publications" / "v000002" / "model.safetensors")
    elif damage == "no manifest":
        (d / ckpt.MANIFEST).unlink()
    elif damage == "truncated":
        f = d / "critic.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
    else:
        _flip(d / damage)
    assert _resume(run) == 0
    out = capsys.readouterr().out
    assert "checkpoint update-000002 is not intact" in out and "kept as update-000002.corrupt" in out
    assert (run / "checkpoints" / "update-000002.corrupt").is_dir()
    sessions = json.loads((run / "run.json").read_text())["rl"]["sessions"]
    assert sessions[1]["resumed_from"] == "checkpoints/update-000001"
    event = next(e for e in sessions[1]["events"] if e["event"] == "checkpoint_corrupt")
    assert event["update"] == 2 and event["kept_as"] == "checkpoints/update-000002.corrupt"
    bad = [i.line() for i in compare_runs(full, run) if i.difference]
    assert bad == [], bad


def test_no_intact_checkpoint_left_is_one_clear_error(runs: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    _copy(runs[1], run)
    for k in (1, 2):
        _flip(ckpt.checkpoint_dir(run, k) / "state.pt")
    assert _resume(run) == 1
    err = capsys.readouterr().err
    assert "no intact checkpoint left" in err and "update-000001.corrupt" in err and "new --output" in err


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(runs: tuple[Path, Path], tmp_path: Path) -> None:
    shutil.copytree(runs[0], tmp_path / "run")
    d = ckpt.checkpoint_dir(tmp_path / "run", 2)
    (d / ckpt.MANIFEST).unlink()
    state = torch.load(d / "state.pt", weights_only=False)
    del state["format"]
    torch.save(state, d / "state.pt")
    assert ckpt.verify_checkpoint(d) == [f"{d}: written before checkpoints had manifests; loaded without verifying "
                                         "its bytes"]
    assert ckpt.load_checkpoint(d)["update"] == 2
