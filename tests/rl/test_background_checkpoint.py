"""Checkpoints written in a background thread: the same bytes as in line, from a copy no later step changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hobson import tensorfile
from hobson.errors import StageError
from hobson.rl import checkpoint as ckpt

ARGS = ["--max-new-tokens", "4", "--prompts-per-update", "2", "--completions-per-prompt", "2", "--trainer", "torch"]


def _events(out: Path) -> list[dict]:
    return json.loads((out / "run.json").read_text())["rl"]["sessions"][-1]["events"]


def test_a_capture_is_not_changed_by_the_steps_after_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()

    step()  # the momentum buffers exist from here on
    want_weights = {k: v.clone() for k, v in model.state_dict().items()}
    want_momentum = [b.clone() for b in (opt.state[p]["momentum_buffer"] for p in model.parameters())]
    snap = ckpt.capture(1, actor=model, critic=model, state={"opt": opt.state_dict(), "data_cursor": 7})
    rng_then = torch.get_rng_state()
    step()  # changes weights and momentum in place, and draws from the RNG
    ckpt.write(tmp_path, 1, snap)
    got = ckpt.load_checkpoint(ckpt.checkpoint_dir(tmp_path, 1))
    for k, v in want_weights.items():
        assert torch.equal(got["actor"][k], v) and torch.equal(got["critic"][k], v)
    saved = [got["opt"]["state"][i]["momentum_buffer"] for i in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(saved, want_momentum, strict=True))
    assert not torch.equal(saved[0], opt.state[model.weight]["momentum_buffer"])  # the step did change it
    assert torch.equal(got["rng"]["torch_cpu"], rng_then) and got["update"] == 1 and got["data_cursor"] == 7


def test_background_and_in_line_checkpoints_are_the_same(tmp_path: Path) -> None:
    from hobson.jobs.rl import main

    runs = {"background": tmp_path / "bg", "in_line": tmp_path / "inline"}
    for name, out in runs.items():
        extra = ["--checkpoint-in-line"] if name == "in_line" else []
        assert main(["--algorithm", "ppo", "--output", str(out), "--updates", "3", *ARGS, *extra]) == 0
    for update in (1, 2, 3):
        a, b = (ckpt.load_checkpoint(ckpt.checkpoint_dir(out, update)) for out in runs.values())
        for state in (a, b):  # the settings differ only where the two runs were told to
            for key in ("checkpoint_in_line", "output"):
                state["settings"].pop(key)
        assert a["critic"] is not None
        assert ckpt.first_difference(a, b) is None, f"update {update}"
    bg = _events(runs["background"])
    assert [e["background"] for e in bg if e["event"] == "checkpoint"] == [True, True, True]
    # every background write was waited for and recorded, the last one before the run ended
    assert [e["update"] for e in bg if e["event"] == "checkpoint_written"] == [1, 2, 3]
    assert [e["background"] for e in _events(runs["in_line"]) if e["event"] == "checkpoint"] == [False] * 3
    rows = [json.loads(x) for x in (runs["background"] / "metrics.jsonl").read_text().splitlines()]
    assert all("checkpoint_wait" in r["seconds"] for r in rows)


def test_a_failed_background_write_fails_the_run_then_resume_continues(tmp_path: Path, monkeypatch, capsys) -> None:
    from hobson.jobs.rl import main

    out = tmp_path / "run"
    args = ["--algorithm", "ppo", "--output", str(out), "--updates", "3", *ARGS]
    real = tensorfile.save

    def disk_full_at_update_2(tensors, path, *a, **kw):
        if ".update-000002." in str(path):
            raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(tensorfile, "save", disk_full_at_update_2)
    assert main(args) == 1
    assert "checkpoint of update 2 failed" in capsys.readouterr().err
    assert ckpt.list_checkpoints(out) == [1]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["update-000001"]  # no temporary left
    monkeypatch.setattr(tensorfile, "save", real)
    assert main([*args, "--resume"]) == 0
    assert ckpt.list_checkpoints(out) == [1, 2, 3]


def test_no_room_for_the_copy_writes_in_line(tmp_path: Path, monkeypatch) -> None:
    from hobson.jobs.rl import main

    def out_of_memory(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ckpt, "capture", out_of_memory)
    out = tmp_path / "run"
    assert main(["--output", str(out), "--updates", "2", *ARGS]) == 0
    events = _events(out)
    assert [e["update"] for e in events if e["event"] == "checkpoint_in_line"] == [1, 2]
    assert [e["background"] for e in events if e["event"] == "checkpoint"] == [False, False]
    assert ckpt.list_checkpoints(out) == [1, 2]


def test_wait_names_the_update_whose_write_failed(tmp_path: Path) -> None:
    writer = ckpt.CheckpointWriter(tmp_path)
    bad = ckpt.Snapshot(actor=None, critic=None, state={"unpicklable": lambda: None}, owned=True)
    writer.submit(4, bad)
    assert writer.pending == 4
    with pytest.raises(StageError, match="checkpoint of update 4 failed"):
        writer.wait()
    assert writer.pending is None and writer.wait() is None
    assert list((tmp_path / "checkpoints").iterdir()) == []


SIGTERM_DURING_WRITE = """
import os, signal, sys
from hobson.jobs.rl import exit_on_sigterm, main
from hobson.rl import checkpoint as ckpt

exit_on_sigterm()
write = ckpt.write

def terminated_while_writing(output, update, snap):
    os.kill(os.getpid(), signal.SIGTERM)  # Slurm stops the step while checkpoint 1 is being written
    return write(output, update, snap)

ckpt.write = terminated_while_writing
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_a_background_write_finishes_it_then_exits_143(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "run"
    args = ["--algorithm", "ppo", "--output", str(out), "--updates", "3", *ARGS]
    proc = subprocess.run([sys.executable, "-c", SIGTERM_DURING_WRITE, *args], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert ckpt.list_checkpoints(out) == [1]  # whole: the exit waited for it
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["update-000001"]
    assert ckpt.load_checkpoint(ckpt.checkpoint_dir(out, 1))["update"] == 1
    # a process like the first (same torch thread count, which a resume checks)
    again = subprocess.run([sys.executable, "-m", "jobs.rl", *args, "--resume"], capture_output=True, text=True,
                           timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert again.returncode == 0, again.stderr[-3000:]
    assert ckpt.list_checkpoints(out) == [1, 2, 3]
