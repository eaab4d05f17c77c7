"""The native engine's CUDA-graph decode on a GPU.

- Sampling runs inside the graph: replays must draw each row's noise exactly as eager steps do
  (the rows' generators are registered with the graph).
- Decoding beside another thread that copies GPU tensors to the host, as the background checkpoint
  writer does during the next update's rollout. With graphs recorded in CUDA's default "global"
  capture mode, the writer's copies invalidated the capture (cudaErrorStreamCaptureInvalidated in
  a Huginn ppo run on two H200s).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hobson import tensorfile
from hobson.models import get_provider, tiny_config
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine
from tests.models.decode_attention_cases import split_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engine(tmp_path: Path, kind: str, keep_decode: bool = True, dtype: torch.dtype = torch.float32) -> NativeEngine:
    cfg = tiny_config(kind)
    provider = get_provider(cfg)
    actor = provider.build_actor(cfg, seed=0)
    root = tmp_path / "pub"
    publication.publish(provider, actor, root, 0, model_revision="r", engine_revision="e", dtype=dtype)
    engine_gpu = torch.cuda.device_count() - 1
    engine = NativeEngine(provider, dtype=dtype, device=f"cuda:{engine_gpu}", eos_id=-1, pad_id=0,
                          model_revision="r", engine_revision="e", keep_decode=keep_decode)
    engine.load_publication(publication.version_dir(root, 0))
    return engine


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-attention"])
@pytest.mark.parametrize("kind", ["nanbeige", "huginn_raven"])
def test_graph_replay_samples_as_eager_steps(tmp_path: Path, kind: str, split: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling is inside the decode graph: replays draw each row's noise as eager steps do, also
    when a warm engine replays the first decode step instead of running it eagerly, and when a
    kept graph replays for new seeds and new prompts of the same shape; with the attention's
    cache split over programs too (its partial states live in the graph's memory pool)."""
    if split:
        split_attention(monkeypatch)
    engine = _engine(tmp_path, kind, keep_decode=False)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    seeds = [11, 12, 13, 14]
    captured = []
    capture = NativeEngine._capture

    def counting(step, cache, gens):  # noqa: ANN001, ANN202
        captured.append(len(gens))
        return capture(step, cache, gens)

    monkeypatch.setattr(NativeEngine, "_capture", staticmethod(counting))
    graphed = engine.generate(prompts, seeds, 1.0, 32)  # an eager first decode step, then replays
    assert captured == [len(prompts)]
    warm = engine.generate(prompts, seeds, 1.0, 32)  # this batch size is warm: every decode step replayed
    assert captured == [len(prompts)] * 2
    kept = _engine(tmp_path, kind)
    kept_runs = [kept.generate(prompts, seeds, 1.0, 32)]  # captures once
    other_prompts, other_seeds = [[1, 2, 3, 4], [15], [16, 17], [18, 19, 20]], [21, 22, 23, 24]
    kept_runs.append(kept.generate(other_prompts, other_seeds, 1.0, 32))  # replays the kept graph
    kept_runs.append(kept.generate(prompts, seeds, 1.0, 32))
    assert captured == [len(prompts)] * 3
    monkeypatch.setattr(NativeEngine, "_capture", staticmethod(lambda step, cache, gens: None))
    eager = engine.generate(prompts, seeds, 1.0, 32)
    other_eager = engine.generate(other_prompts, other_seeds, 1.0, 32)
    for run, ref in ((graphed, eager), (warm, eager), (kept_runs[0], eager), (kept_runs[1], other_eager),
                     (kept_runs[2], eager)):
        assert [c.tokens for c in run] == [c.tokens for c in ref]
        assert [c.logprobs for c in run] == [c.logprobs for c in ref]
    assert len({tuple(c.tokens) for c in eager}) == len(prompts)  # rows really sampled, not one argmax


@pytest.mark.parametrize("kind", ["nanbeige", "huginn_raven"])
@pytest.mark.parametrize("route", ["cublas swapped", "cublaslt", "triton"])
def test_bf16_decode_through_a_gemm_route_replays_as_eager(
        tmp_path: Path, kind: str, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 16-bit decode product through one route (skinny.routed): a CUDA graph's tokens and
    log-probs are the eager steps' (the routes are fixed kernels)."""
    from hobson.models import skinny

    used = {"routed": 0}
    routed = skinny.routed

    def counting_routed(x, w, r):  # noqa: ANN001, ANN202
        used["routed"] += 1
        return routed(x, w, r)

    monkeypatch.setattr(skinny, "route", lambda x, w: route if x.dtype != torch.float32 and x.is_cuda
                        and x.numel() // x.shape[-1] <= skinny.MAX_ROWS else None)
    monkeypatch.setattr(skinny, "routed", counting_routed)
    engine = _engine(tmp_path, kind, keep_decode=False, dtype=torch.bfloat16)
    prompts, seeds = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]], [11, 12, 13, 14]
    graphed = engine.generate(prompts, seeds, 1.0, 24)
    assert used["routed"] > 0
    monkeypatch.setattr(NativeEngine, "_capture", staticmethod(lambda step, cache, gens: None))
    eager = engine.generate(prompts, seeds, 1.0, 24)
    assert [c.tokens for c in graphed] == [c.tokens for c in eager]
    assert [c.logprobs for c in graphed] == [c.logprobs for c in eager]
    assert len({tuple(c.tokens) for c in eager}) == len(prompts)


@pytest.mark.parametrize("copier", ["cpu", "tensorfile"])
@pytest.mark.parametrize("kind", ["nanbeige", "huginn_raven"])
def test_graph_decode_beside_a_copying_thread(tmp_path: Path, kind: str, copier: str) -> None:
    """``tensorfile``: the checkpoint writer's own path (pinned staging buffers allocated on the
    first write, side streams, pool threads) while the engine captures and replays its graphs."""
    engine = _engine(tmp_path, kind, keep_decode=False)  # every generate captures beside the copies
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    seeds = [1, 2, 3]
    quiet = engine.generate(prompts, seeds, 1.0, 24)

    stop = threading.Event()
    copies = [0]
    errors: list[BaseException] = []

    def writer() -> None:  # the checkpoint writer's work: device tensors to host memory, on the trainer's GPU
        try:
            big = torch.randn(64, 1 << 20, device="cuda:0")
            while not stop.is_set():
                if copier == "cpu":
                    big.cpu()
                else:
                    tensorfile.save({"big": big}, tmp_path / "big.safetensors")
                copies[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    try:
        busy = [engine.generate(prompts, seeds, 1.0, 24) for _ in range(3)]
    finally:
        stop.set()
        t.join()
    assert not errors and copies[0] > 0
    for run in busy:  # same seeds: the same tokens and log-probs as without the copies
        assert [c.tokens for c in run] == [c.tokens for c in quiet]
        assert [c.logprobs for c in run] == [c.logprobs for c in quiet]


@pytest.mark.parametrize("kind", ["nanbeige", "huginn_raven"])
def test_a_gpu_version_digest_equals_the_cpu_digest_of_its_written_publication(tmp_path: Path, kind: str) -> None:
    """The trainer's GPU tensors are digested on the GPU (``stage``: nothing goes through the
    host); the digest equals the one a CPU computes from the same version's files, and the
    engine on the GPU commits the staged version after its own on-device check."""
    cfg = tiny_config(kind)
    provider = get_provider(cfg)
    actor = provider.build_actor(cfg, seed=0).to("cuda")
    dtype = torch.float16 if kind == "huginn_raven" else torch.float32
    staged = publication.stage(provider, actor, 0, model_revision="r", engine_revision="e", dtype=dtype)
    assert {t.device.type for t in staged.tensors.values()} == {"cuda"}
    written = publication.publish(provider, actor, tmp_path / "pub", 0, model_revision="r", engine_revision="e",
                                  dtype=dtype)
    assert staged.manifest.digest == written.digest
    assert publication.tensors_digest(publication.read_tensors(publication.version_dir(tmp_path / "pub", 0))) \
        == written.digest
    engine = NativeEngine(provider, dtype=dtype, device="cuda", eos_id=-1, pad_id=0, model_revision="r",
                          engine_revision="e")
    assert engine.load_staged(staged).digest == written.digest
