"""``cuda_graphs: true`` on a GPU: a replayed micro-batch gives the eager step's numbers bit for bit
(the same padded batch through the recipe's own micro-batch function), a second batch of a bucket
replays through the same graph, and a run stopped and resumed (its graphs captured again, in
another order) ends bit-identical to the uninterrupted one.

SDPA runs its math backend only (``math_sdpa``): the memory-efficient backward (the one that runs
fp32 and these head sizes) adds with atomics, so two eager backwards of the same batch already
differ in their last bits (session 23's first GPU run of this test showed it) and bit equality
would test the attention kernel, not the graphs. (``attn_implementation: eager`` cannot be
captured: transformers' eager mask copies a number from the host inside the step, session 25.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hobson.decider.checkpoint import load_checkpoint
from hobson.decider.config import load_train_config
from hobson.decider.graphs import MicroBatchGraphs, pad_batch
from hobson.decider.train import DeciderTrainRecipe, recipe_main
from hobson.io import read_jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def math_sdpa():
    """SDPA's math backend only (plain matmuls and softmax: no atomics), restored afterwards."""
    flags = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
             for name in ("flash", "mem_efficient", "cudnn", "math")}
    for name in ("flash", "mem_efficient", "cudnn"):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(False)
    torch.backends.cuda.enable_math_sdp(True)
    yield
    for name, on in flags.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("precompute", [False, True])
def test_a_replayed_micro_batch_is_the_eager_one_bit_for_bit(decider_data, config_factory, tmp_path, bf16,
                                                             precompute):
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out", device="cuda", bf16=bf16,
                                           cuda_graphs=True, micro_batch_size=6, precompute_frozen_kl=precompute))
    recipe = DeciderTrainRecipe(cfg)
    try:
        recipe.setup()
        graphs, params = recipe.graphs, recipe.params
        rows = read_jsonl(decider_data["train"])
        # two batches of one bucket (5 and 6 rows, both under 32 tokens), one of another
        groups = [[0, 3, 6, 9, 12], [1, 4, 7, 10, 13, 16], [2, 5, 8, 11, 14, 17]]
        batches = [recipe.collator.collate([(i, rows[i]) for i in g]) for g in groups]
        keys = [graphs.bucket(b) for b in batches]
        scale = 1 / 17
        # once: the graphs add into the .grad tensors there at their capture (the trainer zeroes them in place)
        for p in params:
            p.grad = torch.zeros_like(p)

        def eager_step(padded, host_frozen):
            # on the graphs' stream: the same stream's cuBLAS workspace, so the same kernel choices
            graphs.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(graphs.stream):
                sums = recipe._micro_batch(padded.to("cuda"), host_frozen, scale).clone()
            torch.cuda.current_stream().wait_stream(graphs.stream)
            torch.cuda.synchronize()
            return sums

        for batch in batches:
            frozen = recipe._frozen_logits(batch) if precompute else None
            length, options = graphs.bucket(batch)
            padded = pad_batch(batch, rows=6, length=length, options=options, pad_id=recipe.collator.pad_id)
            for p in params:
                p.grad.zero_()
            host_frozen = None
            if frozen is not None:
                host_frozen = torch.zeros((6, options))
                host_frozen[: frozen.shape[0], : frozen.shape[1]] = frozen
                host_frozen = host_frozen.cuda()
            eager_sums = eager_step(padded, host_frozen)
            eager = [p.grad.clone() for p in params]
            for p in params:  # the eager step itself repeats bit for bit (else the test says nothing)
                p.grad.zero_()
            assert torch.equal(eager_step(padded, host_frozen), eager_sums)
            assert _differing(params, eager) == []
            for p in params:
                p.grad.zero_()
            graph_sums = graphs.run(batch, frozen, scale).clone()
            torch.cuda.synchronize()
            assert torch.equal(graph_sums, eager_sums)
            assert _differing(params, eager) == []
            assert any(g.any() for g in eager)
        assert len(set(keys)) == len(graphs.graphs) == graphs.captures
        assert graphs.captures < len(batches)  # the second batch of a bucket replayed the first's graph
    finally:
        recipe.cleanup()


def test_a_graphed_run_stopped_and_resumed_ends_bit_identical(config_factory, tmp_path, capsys):
    def run(name: str, **over) -> list[dict]:
        cfg = load_train_config(config_factory(tmp_path / f"{name}.yaml", tmp_path / name, device="cuda", bf16=True,
                                               cuda_graphs=True, graph_length_multiple=16, max_steps=6,
                                               **over))
        capsys.readouterr()
        assert recipe_main(cfg) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        return [r for r in lines if "loss" in r and "rows" in r]

    whole = run("whole")
    first = run("stopped", stop_after_steps=3)
    second = run("stopped")  # resumes at step 4, capturing its graphs again in another order
    assert [r["step"] for r in first + second] == [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    assert first + second == whole  # losses, accuracies, gradient norms, learning rates: every logged number
    # the logged rows are training rows (pad rows taken off): epoch 0 is all 40 of them
    assert sum(r["rows"] for r in whole if r["epoch"] == 0) == 40
    a = load_checkpoint(str(tmp_path / "whole" / "final"), trainer_state=False)
    b = load_checkpoint(str(tmp_path / "stopped" / "final"), trainer_state=False)
    assert a.adapter.keys() == b.adapter.keys() and a.head.keys() == b.head.keys()
    assert all(torch.equal(a.adapter[k], b.adapter[k]) for k in a.adapter)
    assert all(torch.equal(a.head[k], b.head[k]) for k in a.head)


def test_buckets_of_growing_length_share_the_pool_memory(decider_data, config_factory, tmp_path):
    """Graphs captured for four ever longer buckets share their pool: well under the sum of their
    temporaries (session 23: 50 GiB after a few 8-token buckets at 128 rows). The body's
    temporaries grow with the bucket's length, 48 MiB per 32 tokens each, as activations do."""
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out", device="cuda", cuda_graphs=True,
                                           micro_batch_size=6))
    recipe = DeciderTrainRecipe(cfg)
    try:
        recipe.setup()
        rows = read_jsonl(decider_data["train"])
        batch = recipe.collator.collate([(i, rows[i]) for i in range(6)])
    finally:
        recipe.cleanup()
    # the body reads only the padded size: the rows cut to the first bucket's 32 tokens
    batch = dataclasses.replace(batch, input_ids=batch.input_ids[:, :32], attention_mask=batch.attention_mask[:, :32])
    weight = torch.nn.Parameter(torch.ones(4, device="cuda"))

    def body(b, frozen, scale):
        n = b.input_ids.numel() * (1 << 16)  # 6 rows x 32 tokens: 48 MiB of fp32
        x = torch.ones(n, device="cuda") * scale
        y = (x * 2 + 1) * weight[0]
        z = y.sqrt() + x
        weight.grad.add_(z[:4])
        return z.sum(dtype=torch.float64).reshape(1)

    def graphs_for(lengths: list[int]) -> MicroBatchGraphs:
        g = MicroBatchGraphs(body, [weight], torch.device("cuda"), rows=6, length_multiple=32, pad_id=0)
        for length in lengths:
            padded = pad_batch(batch, rows=6, length=length, options=batch.option_pos.shape[1], pad_id=0)
            out = g.run(padded, None, 1.0).clone()
            torch.cuda.synchronize()
            expect = 6 * length * (1 << 16) * (float(torch.tensor(3.0).sqrt()) + 1)
            assert abs(out.item() - expect) <= 1e-6 * expect  # the replay computed the body
        return g

    growing = graphs_for([32, 64, 96, 128])
    assert growing.captures == 4
    grown = growing.pool_bytes()
    longest = graphs_for([128]).pool_bytes()
    one = 6 * 128 * (1 << 16) * 4
    print(f"pool after 4 growing buckets {grown / 2**20:.0f} MiB, longest alone {longest / 2**20:.0f} MiB")
    assert longest >= 2 * one  # the body's temporaries did come from the pool
    # unshared: 48+96+144+192 MiB per temporary, 2.5x the longest; shared, an H100 held 1.83x
    # (3,182 against 1,742 MiB, session 25): a longer bucket's temporaries fit only partly into
    # the shorter ones' freed blocks
    assert grown <= 2.0 * longest
    # a replay adds into the .grad tensors there at capture: fresh ones would silently stay zero
    weight.grad = torch.zeros_like(weight)
    padded = pad_batch(batch, rows=6, length=32, options=batch.option_pos.shape[1], pad_id=0)
    with pytest.raises(RuntimeError, match=r"\.grad tensors were replaced since the CUDA graphs were captured"):
        growing.run(padded, None, 1.0)


def _differing(params, grads) -> list[tuple[int, float]]:
    """(index, largest difference) of each parameter whose ``.grad`` is not ``grads``' bit for bit."""
    return [(i, float((p.grad.double() - g.double()).abs().max()))
            for i, (p, g) in enumerate(zip(params, grads, strict=True)) if not torch.equal(p.grad, g)]
