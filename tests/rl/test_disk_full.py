"""The disk fills while an RL run writes its next publication (a small tmpfs the test mounts):
one error naming the path and the bytes, nothing half-written, and once space is freed a resume
ends with the uninterrupted run's bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hobson.rl.verify_resume import compare_runs

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--algorithm", "ppo", "--updates", "3", "--max-new-tokens", "4", "--prompts-per-update", "2",
        "--completions-per-prompt", "2", "--trainer", "torch", "--device", "cpu"]


def _rl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.rl", *ARGS, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture
def small_fs(tmp_path: Path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # a filesystem of its own, so "full" is this test's alone (CI runs as root, which may mount)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert p.returncode == 0, f"the disk-full test mounts a tmpfs and must be root: {p.stderr}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_while_publishing_is_one_error_then_a_resume_gives_the_uninterrupted_run(tmp_path, small_fs):
    ref = tmp_path / "ref"
    assert _rl("--output", str(ref)).returncode == 0
    run = small_fs / "run"
    first = _rl("--output", str(run), "--stop-after", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    filler = small_fs / "filler"
    st = os.statvfs(small_fs)
    with open(filler, "wb") as f:  # all but a few pages: no publication fits
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 64 * 1024)
    full = _rl("--output", str(run), "--resume")
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    (line,) = [x for x in full.stderr.splitlines() if x.startswith("rl: error:")]
    # (the resume's republish of version 1 exports it again before comparing digests: that write fails)
    assert "no space left on the device" in line and f"{run / 'publications'}/v00000" in line, line
    assert "needs at least" in line and "bytes are free" in line, line
    assert not [p for p in run.rglob(".*")], "a temporary directory or file was left behind"
    assert not (run / "publications" / "v000002").exists() and not (run / "checkpoints" / "update-000002").exists()
    filler.unlink()
    again = _rl("--output", str(run), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    diffs = [i.line() for i in compare_runs(ref, run) if i.difference]
    assert diffs == [], diffs


def test_disk_full_while_writing_a_checkpoint_is_one_error_then_a_resume_gives_the_uninterrupted_run(
        tmp_path, small_fs):
    """With `--transport dist` no publication file is written, so the first write the full disk
    refuses is update 2's checkpoint: the run stops with one line naming the checkpoint, leaves
    nothing half-written, and a resume after space is freed (checkpoints in the background again)
    ends with the uninterrupted run's bits.

    The full-disk session writes its checkpoint in line (`--checkpoint-in-line`, which a resume
    may change): written in the background, the checkpoint raced update 2's metrics and
    TensorBoard writes for the last free bytes, and a repeat (run 2 on 07947d8) saw that write refused
    first. A background writer's failure stopping the run is tests/rl/test_background_checkpoint.py's."""
    dist = ("--transport", "dist")
    ref = tmp_path / "ref"
    assert _rl("--output", str(ref), *dist).returncode == 0
    run = small_fs / "run"
    first = _rl("--output", str(run), "--stop-after", "1", *dist)
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (run / "publications").exists() or not any((run / "publications").iterdir())
    filler = small_fs / "filler"
    st = os.statvfs(small_fs)
    with open(filler, "wb") as f:  # room for rollouts and records, not for a checkpoint
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 256 * 1024)
    full = _rl("--output", str(run), "--resume", "--checkpoint-in-line", *dist)
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    (line,) = [x for x in full.stderr.splitlines() if x.startswith("rl: error:")]
    assert "no space left on the device" in line and f"{run / 'checkpoints'}/" in line, line
    assert not [p for p in run.rglob(".*")], "a temporary directory or file was left behind"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["update-000001"]
    filler.unlink()
    again = _rl("--output", str(run), "--resume", *dist)
    assert again.returncode == 0, again.stderr[-3000:]
    diffs = [i.line() for i in compare_runs(ref, run) if i.difference]
    assert diffs == [], diffs


def test_a_full_disk_under_any_small_write_names_its_file(small_fs, capsys, monkeypatch):
    """Metrics rows, records and plots go through ``atomic_write``; TensorBoard through its writer.
    When the disk is full there, the message names that file or directory, not "a write", and
    the temporary file is gone."""
    from hobson.errors import DiskFull, internal_error
    from hobson.io import atomic_write

    filler = small_fs / "filler"
    st = os.statvfs(small_fs)
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
    target = small_fs / "run" / "metrics.jsonl"
    with pytest.raises(DiskFull) as e, atomic_write(target) as f:
        f.write("x" * (1 << 20))
    assert str(e.value).startswith(f"{target}: no space left on the device"), e.value
    assert "free space" in str(e.value) and "resume" in str(e.value)
    assert not target.exists() and not list(target.parent.iterdir()), "the temporary file was left behind"
    # a write hobson does not wrap (a library's) still names where the run was, never "a write"
    monkeypatch.chdir(small_fs)
    assert internal_error(OSError(28, "No space left on device"), "rl") == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rl: error: a write under {small_fs}: no space left on the device"), err
