"""Disk retention of RL runs: ``keep_publications`` and ``keep_checkpoints``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hobson.errors import DigestMismatch
from hobson.models import PROVIDERS, tiny_config
from hobson.rl import checkpoint as ckpt
from hobson.rl import publication


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
