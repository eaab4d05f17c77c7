"""The native engine keeps its last decode (KV cache, step buffers, generators, and on CUDA the
captured graph) for the next generate of the same shape. A kept decode must serve exactly as a new
one: same tokens and log-probs, bit for bit, for new seeds, new prompts and new weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hobson.models import get_provider, tiny_config
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine

KINDS = ["huginn_raven", "nanbeige"]


def _versions(tmp_path: Path, kind: str) -> tuple[object, Path]:
    """Versions 0 and 1 of a tiny model, with different weights."""
    cfg = tiny_config(kind)
    provider = get_provider(cfg)
    root = tmp_path / "pubs"
    for v in (0, 1):
        actor = provider.build_actor(cfg, seed=3 + v)
        publication.publish(provider, actor, root, v, model_revision="r", engine_revision="e", dtype=torch.float32)
    return provider, root


def _engine(provider: object, root: Path, version: int, keep: bool) -> NativeEngine:
    e = NativeEngine(provider, dtype=torch.float32, device="cpu", eos_id=0, pad_id=0, model_revision="r",
                     engine_revision="e", keep_decode=keep)
    e.load_publication(publication.version_dir(root, version))
    return e


def _same(a: list, b: list) -> None:
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    assert [c.trace for c in a] == [c.trace for c in b]
    assert [(c.version, c.digest) for c in a] == [(c.version, c.digest) for c in b]


@pytest.mark.parametrize("kind", KINDS)
def test_a_kept_decode_serves_new_seeds_prompts_and_shapes_as_a_new_one(tmp_path: Path, kind: str) -> None:
    provider, root = _versions(tmp_path, kind)
    kept, fresh = _engine(provider, root, 0, True), _engine(provider, root, 0, False)
    calls = [
        ([[5, 6, 7, 8], [9, 10], [11, 12, 13]], [1, 2, 3], 12),
        ([[5, 6, 7, 8], [9, 10], [11, 12, 13]], [4, 5, 6], 12),  # same shape, new seeds
        ([[21, 22], [23, 24, 25, 26], [27]], [7, 8, 9], 12),  # same shape, new prompts (stale keys in the cache)
        ([[30, 31, 32, 33, 34, 35], [36], [37, 38]], [1, 2, 3], 12),  # a longer prompt: a new decode
        ([[5, 6, 7, 8], [9, 10], [11, 12, 13]], [1, 2, 3], 12),  # back to the first shape
    ]
    decodes = []
    for prompts, seeds, n in calls:
        _same(kept.generate(prompts, seeds, 0.9, n), fresh.generate(prompts, seeds, 0.9, n))
        decodes.append(kept._decode)
        assert fresh._decode is None  # keep_decode=False keeps nothing
    assert decodes[0] is decodes[1] is decodes[2]  # reused, not rebuilt
    assert decodes[3] is not decodes[2] and decodes[4] is not decodes[3]  # one kept shape at a time
    assert len({tuple(c.tokens) for c in fresh.generate(*calls[0][:2], 0.9, 12)}) == 3  # rows really sample
    kept.release()
    assert kept._decode is None
    _same(kept.generate(*calls[1][:2], 0.9, 12), fresh.generate(*calls[1][:2], 0.9, 12))


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_version_is_copied_into_the_kept_decode_model(tmp_path: Path, kind: str) -> None:
    """Loading version 1 while a decode is kept copies its weights into the served model (the kept
    graph reads that memory); the result equals an engine that loaded version 1 from scratch."""
    provider, root = _versions(tmp_path, kind)
    kept = _engine(provider, root, 0, True)
    prompts, seeds = [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [1, 2, 3]
    v0 = kept.generate(prompts, seeds, 0.9, 12)
    model, decode = kept.model, kept._decode
    man = kept.load_publication(publication.version_dir(root, 1))
    assert kept.model is model and kept._decode is decode and (kept.version, kept.digest) == (1, man.digest)
    v1 = kept.generate(prompts, seeds, 0.9, 12)
    assert kept._decode is decode
    _same(v1, _engine(provider, root, 1, False).generate(prompts, seeds, 0.9, 12))
    assert [c.tokens for c in v1] != [c.tokens for c in v0]  # the weights really changed


def test_a_model_whose_tensors_moved_gets_a_new_decode(tmp_path: Path) -> None:
    """Stacking the projections again moves q/k/v into new memory: a graph of the old addresses
    would read freed memory, so the engine builds a new decode."""
    provider, root = _versions(tmp_path, "nanbeige")
    kept, fresh = _engine(provider, root, 0, True), _engine(provider, root, 0, False)
    prompts, seeds = [[5, 6, 7, 8], [9, 10]], [1, 2]
    kept.model.fuse_projections(True)
    first = kept.generate(prompts, seeds, 0.9, 8)
    decode = kept._decode
    kept.model.fuse_projections(True)  # a new stacked tensor; q/k/v become views of it
    _same(kept.generate(prompts, seeds, 0.9, 8), first)
    assert kept._decode is not decode
    _same(first, fresh.generate(prompts, seeds, 0.9, 8))
