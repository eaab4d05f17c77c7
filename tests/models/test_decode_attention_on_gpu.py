"""The decode-attention kernel compiled on a GPU, at the official models' head shapes, and in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hobson.models import decode_attention, get_provider, tiny_config
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine
from tests.models.decode_attention_cases import reference_and_kernel, split_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("triton")

# (query heads, KV heads, head size): Nanbeige4.2-3B (GQA, 6 query heads per KV head), Huginn-0125
SHAPES = {"nanbeige": (48, 8, 128), "huginn": (55, 55, 96)}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("split", [1, 3], ids=["whole", "split3"])
@pytest.mark.parametrize("dot", [True, False], ids=["dot", "elementwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("pos", [0, 31, 175])
def test_kernel_matches_update_then_attend(model: str, dtype: torch.dtype, pos: int, dot: bool, split: int) -> None:
    """Both product forms (the plan picks one per shape) at the official head shapes, with the
    cache whole or split over three programs per KV head."""
    H, hkv, D = SHAPES[model]
    p = decode_attention.Plan(block=32 if dot else 16, dot=dot, split=split)
    (y_ref, k_ref, v_ref), (y, k, v) = reference_and_kernel(16, H, hkv, D, 176, pos, dtype, "cuda", plan=p)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    err = float((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max())
    assert err < TOL[dtype], err
    again = reference_and_kernel(16, H, hkv, D, 176, pos, dtype, "cuda", plan=p)[1][0]
    assert torch.equal(y, again)  # no atomics: the same bits on every run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pos", [0, 175])
def test_kernel_with_rope_matches_nanbeige(dtype: torch.dtype, pos: int) -> None:
    """RoPE inside the kernel, with the plan's launch, against Nanbeige's eager RoPE then update +
    attend: the rotated key within one rounding, the output within the dtype's bound."""
    H, hkv, D = SHAPES["nanbeige"]
    (y_ref, k_ref, _), (y, k, _) = reference_and_kernel(16, H, hkv, D, 176, pos, dtype, "cuda", rope=True)
    scale = k_ref.float().abs().max()
    assert float((k.float() - k_ref.float()).abs().max() / scale) < (1e-6 if dtype == torch.float32 else 8e-3)
    err = float((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max())
    assert err < TOL[dtype], err


def _engine(root: Path, kind: str) -> NativeEngine:
    cfg = tiny_config(kind)
    provider = get_provider(cfg)
    publication.publish(provider, provider.build_actor(cfg, seed=0), root, 0, model_revision="r", engine_revision="e",
                        dtype=torch.float32)
    engine = NativeEngine(provider, dtype=torch.float32, device="cuda", eos_id=-1, pad_id=0, model_revision="r",
                          engine_revision="e", keep_decode=False)
    engine.load_publication(publication.version_dir(root, 0))
    return engine


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-attention"])
@pytest.mark.parametrize("kind", ["nanbeige", "huginn_raven"])
def test_the_engine_decodes_through_the_kernel(tmp_path: Path, kind: str, split: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step's attention goes through the kernel (one call per layer and step while
    the first step runs eagerly); the tokens equal those of an engine with the kernel off and the
    log-probs agree to fp32 rounding. The switch is read per process in use, so the kernel-off run
    gets its own engine: one engine switched mid-life would capture its graph around paths its
    eager first step never compiled (inductor's autotuning syncs, which breaks the capture).
    Also with the cache split over programs, combined by the second kernel."""
    if split:
        split_attention(monkeypatch)
    engine = _engine(tmp_path / "on", kind)
    prompts, seeds = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]], [11, 12, 13, 14]
    calls = [0]
    attend = decode_attention.attend

    def counting(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return attend(*a, **kw)

    monkeypatch.setattr(decode_attention, "attend", counting)
    on = engine.generate(prompts, seeds, 1.0, 24)
    assert calls[0] > 0
    monkeypatch.setenv("HOBSON_DECODE_ATTENTION", "0")
    off = _engine(tmp_path / "off", kind).generate(prompts, seeds, 1.0, 24)
    assert [c.tokens for c in on] == [c.tokens for c in off]
    for a, b in zip(on, off, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
