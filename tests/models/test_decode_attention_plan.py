"""The decode-attention kernel's launch plans: pure functions of the shapes (no triton needed)."""

from __future__ import annotations

import pytest
import torch

from hobson.models import decode_attention


def test_a_split_chunks_the_capacity_in_whole_blocks() -> None:
    """The chunk is the capacity over ``split``, rounded up to whole blocks and never below one."""
    p = decode_attention.Plan(block=64, split=3)
    assert [p.chunk(c) for c in (176, 192, 193, 1024, 10)] == [64, 64, 128, 384, 64]
    assert decode_attention.Plan(block=16, split=3).chunk(48) == 16


@pytest.fixture
def split_env(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    decode_attention._split_override.cache_clear()
    yield monkeypatch
    decode_attention._split_override.cache_clear()


def test_the_split_override_applies_to_every_plan(split_env: pytest.MonkeyPatch) -> None:
    """``HOBSON_DECODE_SPLIT=N`` keeps each plan's launch and splits its cache over N programs."""
    whole = decode_attention.plan(1, 96, torch.bfloat16)
    assert whole.split == 1
    split_env.setenv("HOBSON_DECODE_SPLIT", "3")
    decode_attention._split_override.cache_clear()
    for args in ((1, 96, torch.bfloat16), (6, 128, torch.bfloat16), (6, 128, torch.float32)):
        p = decode_attention.plan(*args)
        assert p.split == 3
        decode_attention._split_override.cache_clear()
        split_env.delenv("HOBSON_DECODE_SPLIT")
        assert p == decode_attention.Plan(**{**decode_attention.plan(*args).__dict__, "split": 3})
        split_env.setenv("HOBSON_DECODE_SPLIT", "3")
        decode_attention._split_override.cache_clear()


@pytest.mark.parametrize("raw", ["0", "two", "-1", ""])
def test_a_bad_split_override_is_one_error_naming_it(split_env: pytest.MonkeyPatch, raw: str) -> None:
    split_env.setenv("HOBSON_DECODE_SPLIT", raw)
    with pytest.raises(ValueError, match="HOBSON_DECODE_SPLIT"):
        decode_attention.plan(1, 96, torch.bfloat16)
