"""The decode-attention kernel's launch plans: pure functions of the shapes (no triton needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hobson.models import decode_attention


def test_a_split_chunks_the_capacity_in_whole_blocks() -> None:
    """The chunk is the capacity over ``split``, rounded up to whole blocks and never below one."""
    p = decode_attention.Plan(block=64, split=3)
    assert [p.chunk(c) for c in (176, 192, 193, 1024, 10)] == [64, 64, 128, 384, 64]
    assert decode_attention.Plan(block=16, split=3).chunk(48) == 16


@pytest.fixture
def plan_env(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    decode_attention._plan_override.cache_clear()
    yield monkeypatch
    decode_attention._plan_override.cache_clear()


def test_the_plan_override_applies_to_every_plan(plan_env: pytest.MonkeyPatch) -> None:
    """``HOBSON_DECODE_PLAN`` replaces the fields it names in each plan and keeps the rest."""
    shapes = ((1, 96, torch.bfloat16), (6, 128, torch.bfloat16), (6, 128, torch.float32))
    plans = [decode_attention.plan(*a) for a in shapes]
    assert all(p.split == 1 for p in plans)
    plan_env.setenv("HOBSON_DECODE_PLAN", "split=3, block=32")
    decode_attention._plan_override.cache_clear()
    for a, p in zip(shapes, plans, strict=True):
        assert decode_attention.plan(*a) == dataclasses.replace(p, split=3, block=32)


@pytest.mark.parametrize("raw", ["split=0", "split=two", "bogus=1", "split", "", "block=8"])
def test_a_bad_plan_override_is_one_error_naming_it(plan_env: pytest.MonkeyPatch, raw: str) -> None:
    plan_env.setenv("HOBSON_DECODE_PLAN", raw)
    with pytest.raises(ValueError, match="HOBSON_DECODE_PLAN"):
        decode_attention.plan(1, 96, torch.bfloat16)
