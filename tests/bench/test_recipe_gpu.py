"""``bench/recipe_gpu.py`` keeps working: the published shapes, and every part at ``--shape tiny`` on a CPU.

The GPU figures come from the same code at ``--shape official --device cuda``; here the tiny run
goes through the real labeller, the real training recipe (``torso_init: random`` Qwen3.5 torso,
the torch Gated DeltaNet path, per-step figures from its ``on_step`` hook) and a real 2-rank
torchrun (gloo), and the JSON must hold every figure.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rg():
    spec = importlib.util.spec_from_file_location("recipe_gpu", REPO / "bench" / "recipe_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return 4096


def test_official_shapes_are_the_published_models(rg):
    """Built on the meta device: Qwen3.5-2B's 1,881,825,088 parameters, Qwen3-4B's 4,022,468,096."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        torso = AutoModelForCausalLM.from_config(rg.torso_config("official", _Tok()))
        teacher = AutoModelForCausalLM.from_config(rg.teacher_config("official", _Tok()))
    assert type(torso).__name__ == "Qwen3_5ForCausalLM"
    assert sum(p.numel() for p in torso.parameters()) == 1_881_825_088
    assert torso.config.layer_types.count("linear_attention") == 18
    assert torso.config.layer_types.count("full_attention") == 6
    assert sum(p.numel() for p in teacher.parameters()) == 4_022_468_096
    n_mm = rg.matmul_params(torso.base_model)
    assert n_mm == 1_372_717_056  # embeddings excluded
    fl = rg.flops_per_token(torso.config, n_mm, 0, mean_context=32, frozen_forward=True, recompute=True)
    assert fl["forward"] == 2 * n_mm + fl["attention_core"] + fl["gated_deltanet_core"]
    assert fl["backward"] == 2 * n_mm + 2 * (fl["attention_core"] + fl["gated_deltanet_core"])
    assert fl["model"] == fl["forward"] + fl["backward"] + fl["frozen_forward"]
    assert fl["mean_context"] == 32  # (L + 1) / 2 for causal rows of 63 tokens: attended_pairs / tokens
    assert fl["attention_core"] == 6 * 4 * 8 * 256 * 32


@pytest.mark.slow
def test_all_parts_tiny_on_cpu(rg, tmp_path, capsys):
    """Slow (~20 s on 2 cores): every part of the bench (labelling, training, the decider's replay
    labelling, DDP as one process and as two local ranks) runs for real on the tiny shape, and the
    8-GPU projection reads its JSON."""
    out = tmp_path / "all.json"
    threads = torch.get_num_threads()
    rc = rg.main(["all", "--device", "cpu", "--shape", "tiny", "--json", str(out), "--workdir", str(tmp_path / "work")])
    assert torch.get_num_threads() == threads
    fig = json.loads(out.read_text())
    assert rc == 0, {part: fig[part].get("error") for part in ("label", "train", "replay", "ddp") if part in fig}
    printed = capsys.readouterr().out
    for title in ("### label:", "### train:", "### replay:", "### ddp:", "### wall seconds per part"):
        assert title in printed

    label = fig["label"]
    assert label["rows"] == 48 and label["tokens"] > 48 and label["naive"]["rows"] == 8
    for part in ("batched", "naive", "full_forward"):
        assert label[part]["tokens_per_s"] > 0
    assert label["batched"]["shard_rows"] == 48
    assert label["batched_over_full_forward"] == pytest.approx(
        label["batched"]["tokens_per_s"] / label["full_forward"]["tokens_per_s"], abs=2e-3)
    assert label["full_forward"]["tokens"] >= label["tokens"]
    assert label["max_abs_prob_diff_batched_vs_naive"] < 1e-4  # fp32: padding changes nothing but rounding

    train = fig["train"]
    assert train["steps"] == 2 and train["rows"] == 2 * 32  # micro_batch_size 16 x grad_accum 2
    assert train["tokens_per_s"] > 0 and train["padded_tokens"] >= train["tokens"]
    assert 0 < train["mfu"] < 1 and 0 < train["mfu_6n"] < 1 and train["peak"]["tflops"] > 0
    assert train["gated_deltanet"]["chunk_gated_delta_rule"] == "torch"
    # 3 Gated DeltaNet layers x (grad forward + frozen forward) x 2 micro-batches x 3 steps (1 warm-up)
    assert train["gated_deltanet"]["calls"] == 3 * 2 * 2 * 3
    assert train["recipe"]["frozen_forward_per_micro_batch"] is True
    assert train["torso"]["config"]["gated_deltanet_layers"] == 3
    f = train["flops_per_token"]
    assert f["model"] == pytest.approx(f["forward"] + f["backward"] + f["frozen_forward"], rel=1e-6)
    base = train["baseline"]  # transformers + peft on the very micro-batches the recipe trained
    assert (base["steps"], base["rows"], base["tokens"]) == (train["steps"], train["rows"], train["tokens"])
    assert base["flops_per_token"] == pytest.approx(f["forward"] + f["backward"], rel=1e-6)  # no frozen forward
    assert train["ratio_tokens_per_s"] == pytest.approx(train["tokens_per_s"] / base["tokens_per_s"], rel=2e-3)

    replay = fig["replay"]  # the decider labels the same rows the teacher did, as jobs.replay does
    assert replay["rows"] == replay["shard_rows"] == 48 and replay["rows_per_s"] > 0 and replay["tokens"] > 48

    import projection  # bench/projection.py reads this JSON as it would a GPU run's

    assert projection.main([str(out), "--scales", "1", "--json", str(tmp_path / "proj.json")]) == 0
    assert json.loads((tmp_path / "proj.json").read_text())["results"][0]["rows"] == 48

    ddp = fig["ddp"]
    assert [r["rank"] for r in ddp["ranks"]] == [0, 1] and all(r["rc"] == 0 for r in ddp["ranks"])
    assert len(ddp["grad_rel_diff_per_step"]) == 3 and ddp["rendering_equal"]
    assert ddp["worst_grad_rel_diff"] < ddp["cpu_test_bound"] == 1e-5
    assert ddp["grads_within_cpu_test_bound"] and ddp["params_within_cpu_test_bound"]
    assert ddp["tensors_compared"] > 0
    assert all(r["gated_deltanet"]["calls"] > 0 for r in ddp["ranks"])
    assert set(fig["environment"]) >= {"torch", "transformers", "peft"}


def test_train_profile_tiny_on_cpu(rg, tmp_path, capsys):
    """``--profile 1`` profiles one step after the timed ones, which stay as they were."""
    out = tmp_path / "train.json"
    rc = rg.main(["train", "--device", "cpu", "--shape", "tiny", "--profile", "1", "--json", str(out),
                  "--workdir", str(tmp_path / "work")])
    fig = json.loads(out.read_text())["train"]
    assert rc == 0, fig.get("error")
    assert fig["steps"] == 2 and fig["rows"] == 2 * 32
    assert len(fig["step_s"]) == fig["warmup_steps"] + 2 and all(t > 0 for t in fig["step_s"])
    assert fig["gated_deltanet"]["calls"] == 3 * 2 * 2 * 4  # warm-up, 2 timed, 1 profiled
    prof = fig["profile"]
    assert prof["steps"] == 1 and prof["wall_ms_per_step"] > 0 and prof["aten_ops_per_step"] > 100
    names = {r["name"] for r in prof["top_host_ops"]}
    assert "aten::linalg_solve_triangular" in names or "aten::mm" in names
    # where the host's ops come from: the torso's modules by class, the backward by autograd node
    owners = {r["owner"]: r["ops_per_step"] for r in prof["host_ops_by_owner"]}
    assert owners.get("Qwen3_5GatedDeltaNet", 0) > 0 and owners.get("Qwen3_5MLP", owners.get("Linear", 0)) > 0
    assert any(o.startswith("backward: ") for o in owners)
    assert sum(owners.values()) <= prof["aten_ops_per_step"]
    text = capsys.readouterr().out
    assert "### profile: train, 1 steps after the timed ones" in text and "| ops called from |" in text


def test_profile_helpers():
    spec = importlib.util.spec_from_file_location("common", REPO / "bench" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)

    assert common._busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    # module ranges and torch's annotations on the GPU timeline are not kernels
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    ev = [SimpleNamespace(device_type=DeviceType.CUDA, name="nvjet_sm90_tst", is_user_annotation=False),
          SimpleNamespace(device_type=DeviceType.CUDA, name="module::Decider", is_user_annotation=False),
          SimpleNamespace(device_type=DeviceType.CUDA, name="ProfilerStep#3", is_user_annotation=True),
          SimpleNamespace(device_type=DeviceType.CPU, name="aten::mm", is_user_annotation=False)]
    assert [e.name for e in common.kernel_events(ev)] == ["nvjet_sm90_tst"]
    assert common.family("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert common.family("void trsm_left_kernel<float>") == "triangular solve"
    assert common.family("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"


def test_the_recorded_commit_says_when_the_tree_is_not_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A result names the commit it ran, and ``+dirty`` where tracked files differ from it (a lent GPU
    machine's copy: a ``.git`` of an earlier commit beside a newer tree); ``$HOBSON_BENCH_COMMIT``
    overrides; no repository gives None."""
    spec = importlib.util.spec_from_file_location("common", REPO / "bench" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    monkeypatch.delenv("HOBSON_BENCH_COMMIT", raising=False)
    assert common.commit(tmp_path) is None
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "f.py").write_text("a = 1\n")
    subprocess.run([*git, "add", "f.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "one"], cwd=tmp_path, check=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert common.commit(tmp_path) == sha
    (tmp_path / "f.py").write_text("a = 2\n")
    assert common.commit(tmp_path) == sha + "+dirty"
    monkeypatch.setenv("HOBSON_BENCH_COMMIT", "abc")
    assert common.commit(tmp_path) == "abc"
