"""Disk retention of RL runs: ``keep_publications`` and ``keep_checkpoints``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hobson.errors import DigestMismatch, StageError
from hobson.models import PROVIDERS, tiny_config
from hobson.rl import checkpoint as ckpt
from hobson.rollout import publication


def test_prune_publications_keeps_manifests(tmp_path: Path) -> None:
    provider = PROVIDERS["nanbeige"]
    actor = provider.build_actor(tiny_config("nanbeige"), seed=0)
    root = tmp_path / "pubs"
    mans = [
        publication.publish(provider, actor, root, v, model_revision="r", engine_revision="e", dtype=torch.float32)
        for v in range(3)
    ]
    assert publication.prune(root, 0) == []
    assert publication.prune(root, 1) == [0, 1]
    for v, man in enumerate(mans):
        d = publication.version_dir(root, v)
        assert publication.Manifest.read(d).digest == man.digest  # the record of every version stays
        assert any(p.suffix == ".safetensors" for p in d.iterdir()) == (v == 2)
    publication.verify(publication.version_dir(root, 2))
    # a run stopped after pruning v1 resumes from the v1 checkpoint: republishing v1 writes its weights
    # again under the recorded manifest, and a different tensor is still refused
    again = publication.publish(provider, actor, root, 1, model_revision="r", engine_revision="e", dtype=torch.float32)
    assert again == mans[1]
    assert publication.verify(publication.version_dir(root, 1))[1] == mans[1].digest
    other = provider.build_actor(tiny_config("nanbeige"), seed=1)
    publication.prune(root, 1)
    with pytest.raises(DigestMismatch, match="version 1 exists with digest"):
        publication.publish(provider, other, root, 1, model_revision="r", engine_revision="e", dtype=torch.float32)


def test_prune_checkpoints_keeps_the_newest(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    for update in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, update, actor=model, critic=None, state={"data_cursor": update})
    assert ckpt.prune_checkpoints(tmp_path, 0) == []
    assert ckpt.prune_checkpoints(tmp_path, 2) == [1]
    assert ckpt.list_checkpoints(tmp_path) == [2, 3]
    assert ckpt.load_checkpoint(ckpt.checkpoint_dir(tmp_path, 3))["data_cursor"] == 3


def test_resume_removes_what_a_killed_process_left_behind(tmp_path: Path) -> None:
    from hobson.jobs.rl import main

    out = tmp_path / "run"
    args = ["--output", str(out), "--updates", "2", "--max-new-tokens", "4", "--prompts-per-update", "2",
            "--completions-per-prompt", "2", "--trainer", "torch"]
    assert main([*args, "--stop-after", "1"]) == 0
    # what SIGKILL leaves: a publication and a checkpoint half-written to their hidden siblings
    (out / "publications" / ".v000002.x1y2z3" / "pub").mkdir(parents=True)
    (out / "publications" / ".v000002.x1y2z3" / "pub" / "model.safetensors").write_bytes(b"half")
    (out / "checkpoints" / ".update-000002.a1b2c3").mkdir()
    assert main([*args, "--resume"]) == 0
    assert [str(p.relative_to(out)) for p in out.rglob(".*")] == []
    events = json.loads((out / "run.json").read_text())["rl"]["sessions"][-1]["events"]
    removed = [e["paths"] for e in events if e["event"] == "removed_stale_temporaries"]
    assert removed == [["publications/.v000002.x1y2z3", "checkpoints/.update-000002.a1b2c3"]]
    assert ckpt.list_checkpoints(out) == [1, 2]


SIGTERM_IN_PUBLISH = """
import os, signal, sys
import torch
from hobson.jobs.rl import exit_on_sigterm
from hobson.models import PROVIDERS, tiny_config
from hobson.rollout import publication

exit_on_sigterm()
provider = PROVIDERS["huginn_raven"]
actor = provider.build_actor(tiny_config("huginn_raven"), seed=0)
write = publication.write_checkpoint

def write_then_terminated(path, tensors, config, *a):
    write(path, tensors, config, *a)  # the weights are on disk in the temporary directory ...
    assert any(path.iterdir())
    os.kill(os.getpid(), signal.SIGTERM)  # ... when Slurm stops the step

publication.write_checkpoint = write_then_terminated
publication.publish(provider, actor, sys.argv[1], 0, model_revision="r", engine_revision="e", dtype=torch.float32)
print("not reached")
"""


def test_sigterm_while_publishing_leaves_no_temporary_directory(tmp_path: Path) -> None:
    root = tmp_path / "pubs"
    proc = subprocess.run([sys.executable, "-c", SIGTERM_IN_PUBLISH, str(root)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 143, proc.stderr
    assert "not reached" not in proc.stdout
    assert root.is_dir() and list(root.iterdir()) == []


def test_checkpoints_read_the_actor_from_their_publication_which_pruning_keeps(tmp_path: Path) -> None:
    from hobson.jobs.rl import main

    out = tmp_path / "run"
    args = ["--output", str(out), "--updates", "3", "--max-new-tokens", "4", "--prompts-per-update", "2",
            "--completions-per-prompt", "2", "--trainer", "torch", "--keep-publications", "1",
            "--keep-checkpoints", "2"]
    assert main([*args, "--stop-after", "2"]) == 0
    assert json.loads((out / "run.json").read_text())["rl"]["sessions"][-1]["checkpoint_actor"] == "publication"
    for update in (1, 2):
        d = ckpt.checkpoint_dir(out, update)
        assert not (d / "actor.safetensors").exists()
        state = ckpt.load_checkpoint(d)  # reads v{update}, digest-checked
        assert state["actor_publication"] == f"publications/v{update:06d}"
    # keep_publications 1 would leave only v2's weights; v1's stay while checkpoint 1 reads them
    has_weights = [any(p.suffix == ".safetensors" for p in publication.version_dir(out / "publications", v).iterdir())
                   for v in range(3)]
    assert has_weights == [False, True, True]
    # the run also published v3 and was killed before checkpoint 3 (v3 from an uninterrupted run:
    # the resume reproduces its bytes): the resume starts from checkpoint 2 and its first
    # publication, v2 again, must not prune v2 although v3 is the newest
    full = tmp_path / "full"
    assert main([*[a if a != str(out) else str(full) for a in args]]) == 0
    shutil.copytree(publication.version_dir(full / "publications", 3), publication.version_dir(out / "publications", 3))
    assert main([*args, "--resume"]) == 0
    assert ckpt.list_checkpoints(out) == [2, 3]
    assert ckpt.load_checkpoint(ckpt.checkpoint_dir(out, 2))["actor_publication"] == "publications/v000002"
    has_weights = [any(p.suffix == ".safetensors" for p in publication.version_dir(out / "publications", v).iterdir())
                   for v in range(4)]
    assert has_weights == [False, False, True, True]
    # a checkpoint whose publication lost its weights says so
    for p in publication.version_dir(out / "publications", 2).iterdir():
        if p.name not in ("manifest.json", "config.json"):  # what pruning removes
            p.unlink()
    with pytest.raises(StageError, match="publication .*v000002, whose weights are missing"):
        ckpt.load_checkpoint(ckpt.checkpoint_dir(out, 2))
