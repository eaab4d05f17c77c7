"""The recipe's hooks for benchmarks: per-step stats (``on_step``), a random torso
(``torso_init: random``) and the Gated DeltaNet kernel setting (``gated_delta_rule``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hobson.decider import kernels
from hobson.decider.config import load_train_config, resume_conflicts
from hobson.decider.kernels import select_gated_delta_rule
from hobson.decider.model import load_torso
from hobson.decider.train import DeciderTrainRecipe, StepStats
from hobson.errors import ConfigError

LINEAR_LAYERS = 3  # the tiny Qwen3.5 torso below: 3 Gated DeltaNet layers, 1 full attention


@pytest.fixture(scope="module")
def qwen35_dir(decider_data, tmp_path_factory) -> Path:
    """A directory with nothing but a tiny Qwen3.5 config.json (no weights)."""
    from transformers import AutoTokenizer, Qwen3_5TextConfig

    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    out = tmp_path_factory.mktemp("qwen35")
    Qwen3_5TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_conv_kernel_dim=4, max_position_embeddings=512, tie_word_embeddings=True,
                      layer_types=["linear_attention"] * LINEAR_LAYERS + ["full_attention"],
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    return out


def _steps(recipe: DeciderTrainRecipe, n: int) -> list[list[list[int]]]:
    out = []
    for _, _, micro in recipe.sampler:
        out.append(micro)
        recipe.sampler.advance()
        if len(out) == n:
            return out
    return out


def test_on_step_reports_the_padding_the_batches_hold(config_factory, tmp_path):
    """Rows, real tokens (attention mask), padded tokens and attended pairs of each step equal a
    count made from the same micro-batches collated again; seconds are the steps' own."""
    steps = 3
    cfg = load_train_config(config_factory(tmp_path / "train.yaml", tmp_path / "out"),
                            ["resume=false", f"stop_after_steps={steps}"])
    seen: list[StepStats] = []
    recipe = DeciderTrainRecipe(cfg, on_step=seen.append)
    try:
        recipe.setup()
        start = time.perf_counter()
        assert recipe.train() == 0
        wall = time.perf_counter() - start
    finally:
        recipe.cleanup()
    assert [s.step for s in seen] == [1, 2, 3]
    assert 0 < sum(s.seconds for s in seen) <= wall

    # The same schedule and renderings, from a second recipe that only collates.
    again = DeciderTrainRecipe(load_train_config(config_factory(tmp_path / "t2.yaml", tmp_path / "o2"),
                                                 ["resume=false"]))
    try:
        again.setup()
        for stats, micro in zip(seen, _steps(again, steps), strict=True):
            batches = [again.collator.collate([(i, again.rows[i]) for i in mb]) for mb in micro]
            real = [int(n) for b in batches for n in b.attention_mask.sum(dim=1)]
            assert stats.rows == len(real) == sum(len(mb) for mb in micro)
            assert stats.tokens == sum(real)
            assert stats.padded_tokens == sum(b.attention_mask.numel() for b in batches) > stats.tokens
            assert stats.attended_pairs == sum(n * (n + 1) // 2 for n in real)
    finally:
        again.cleanup()


def test_random_torso_has_the_configured_shape_and_seeded_weights(qwen35_dir, decider_data):
    from transformers import AutoConfig

    kw = dict(dtype=torch.float32, attn_implementation="sdpa", keep_lm_head=True, init="random")
    torso, lm_w, _ = load_torso(str(qwen35_dir), seed=7, **kw)
    config = AutoConfig.from_pretrained(qwen35_dir)
    assert type(torso).__name__ == "Qwen3_5TextModel"
    assert torso.config.hidden_size == config.hidden_size == 32 and len(torso.layers) == 4
    assert [type(layer.linear_attn).__name__ for layer in torso.layers[:LINEAR_LAYERS]] == \
        ["Qwen3_5GatedDeltaNet"] * LINEAR_LAYERS
    assert lm_w.shape == (config.vocab_size, 32)
    same, _, _ = load_torso(str(qwen35_dir), seed=7, **kw)
    other, _, _ = load_torso(str(qwen35_dir), seed=8, **kw)
    a, b, c = (dict(t.named_parameters()) for t in (torso, same, other))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the seed fixes every weight
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"], c["layers.0.mlp.up_proj.weight"])
    # the default still reads the saved weights
    saved, _, _ = load_torso(str(decider_data["torso"]), dtype=torch.float32, attn_implementation="sdpa",
                             keep_lm_head=False)
    from safetensors.torch import load_file

    on_disk = load_file(str(decider_data["torso"] / "model.safetensors"))
    assert torch.equal(saved.layers[0].mlp.up_proj.weight, on_disk["model.layers.0.mlp.up_proj.weight"])


def _forward(torso: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 21).reshape(2, 10)
    return torso(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state


def test_gated_delta_rule_settings_run_the_path_they_name(qwen35_dir):
    import torch._dynamo
    import transformers.models.qwen3_5.modeling_qwen3_5 as m
    from torch._dynamo.utils import counters

    original = m.torch_chunk_gated_delta_rule
    torso, _, _ = load_torso(str(qwen35_dir), dtype=torch.float32, attn_implementation="sdpa", keep_lm_head=False,
                             init="random")
    with torch.no_grad():
        with select_gated_delta_rule(torso, "torch", "cpu") as choice:
            ref = _forward(torso)
        assert choice.chunk_gated_delta_rule == "torch" and not choice.compiled
        assert choice.calls == LINEAR_LAYERS  # one call per layer per forward
        assert m.torch_chunk_gated_delta_rule is original  # put back

        torch._dynamo.reset()
        counters.clear()
        with select_gated_delta_rule(torso, "compiled", "cpu", compile_backend="eager") as choice:
            out = _forward(torso)
        assert choice.compiled and choice.calls == LINEAR_LAYERS and choice.compile_backend == "eager"
        assert counters["frames"]["ok"] >= 1  # dynamo compiled the rule: the compiled path ran
        torch.testing.assert_close(out, ref)
        torch._dynamo.reset()

        with select_gated_delta_rule(torso, "auto", "cpu") as choice:  # no fla here: transformers' torch path
            torch.testing.assert_close(_forward(torso), ref, rtol=0, atol=0)
        assert choice.chunk_gated_delta_rule == "torch" and choice.fla_backward_error is None

    plain, _, _ = load_torso(str(qwen35_dir), dtype=torch.float32, attn_implementation="sdpa", keep_lm_head=False,
                             init="random")
    with select_gated_delta_rule(plain.layers[-1], "torch", "cpu") as choice:  # full attention only
        assert choice is None


def _dispatch_wrapper(implementation, torch_function):
    """A stand-in for transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper."""
    import functools

    @functools.wraps(torch_function)
    def wrapped(*args, **kwargs):
        return implementation(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("works", [True, False])
def test_auto_keeps_a_working_fla_and_drops_a_broken_one(qwen35_dir, monkeypatch, works):
    """auto probes fla's forward + backward: a kernel that passes is what the layers call, one that
    fails is replaced by the torch function (and named, with its error)."""
    import inspect

    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    from hobson.decider.kernels import _dispatch_function

    # the torch function, past the kernels package's Func module where transformers has one
    torch_fn = inspect.unwrap(_dispatch_function(m.torch_chunk_gated_delta_rule))
    fla_calls = []

    def fla_kernel(*args, **kwargs):
        fla_calls.append(1)
        if not works:
            raise RuntimeError("triton: no kernel image for this GPU")
        return torch_fn(*args, **kwargs)
    fla_kernel.__module__ = "fla.ops.gated_delta_rule.chunk"
    torso, _, _ = load_torso(str(qwen35_dir), dtype=torch.float32, attn_implementation="sdpa", keep_lm_head=False,
                             init="random")
    with torch.no_grad():
        ref = _forward(torso)
    monkeypatch.setattr(m, "torch_chunk_gated_delta_rule", _dispatch_wrapper(fla_kernel, torch_fn))
    # fla's causal convolution beside its rule: here a counting stand-in with the torch numbers
    conv_calls = []

    def fla_conv(hidden_states=None, weight=None, bias=None, activation=None, x=None, **kwargs):
        conv_calls.append(1)
        return kernels.torch_causal_conv1d(hidden_states if hidden_states is not None else x, weight, bias, activation)
    monkeypatch.setattr(kernels, "fla_causal_conv1d", lambda: fla_conv)
    conv_before = getattr(m, kernels.CONV)
    with torch.no_grad(), select_gated_delta_rule(torso, "auto", "cpu") as choice:
        probed = len(fla_calls)
        out = _forward(torso)
    assert probed == 1 and choice.calls == LINEAR_LAYERS
    assert getattr(m, kernels.CONV) is conv_before  # put back
    if works:
        assert choice.chunk_gated_delta_rule == "fla" and choice.fla_backward_error is None, choice
        assert len(fla_calls) == 1 + LINEAR_LAYERS
        # the probe (against the torch convolution, bf16, forward and input gradient), then each layer
        assert choice.causal_conv1d == "fla" and choice.fla_conv_error is None
        assert len(conv_calls) == 1 + LINEAR_LAYERS
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    else:
        assert choice.chunk_gated_delta_rule == "torch"
        assert choice.fla_backward_error.startswith("RuntimeError: triton")
        assert len(fla_calls) == 1  # the probe only
        assert choice.causal_conv1d == "torch" and conv_calls == []


def test_the_torch_causal_conv1d_is_transformers_fallback_bit_for_bit():
    import inspect

    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    from hobson.decider.kernels import _dispatch_function

    fallback = inspect.unwrap(_dispatch_function(getattr(m, kernels.CONV)))
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 12, 9, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    for bias, act in ((None, "silu"), (b, None)):
        ours = kernels.torch_causal_conv1d(x, w, bias, activation=act)
        assert torch.equal(ours, fallback(x, w, bias, activation=act))


def test_recipe_reports_the_kernel_it_trained_with(qwen35_dir, decider_data, config_factory, tmp_path, capsys):
    """A random Qwen3.5 torso trained two steps with gated_delta_rule: torch: the recipe names the
    path and counts every layer's call (grad forward + frozen forward per micro-batch)."""
    cfg = load_train_config(config_factory(tmp_path / "train.yaml", tmp_path / "out"), [
        f"base_model={qwen35_dir}", f"tokenizer={decider_data['torso']}", "torso_init=random",
        "gated_delta_rule=torch", "resume=false", "stop_after_steps=2"])
    recipe = DeciderTrainRecipe(cfg)
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()
    choice = recipe.kernels
    assert choice.setting == "torch" and choice.chunk_gated_delta_rule == "torch"
    assert choice.calls == LINEAR_LAYERS * 2 * cfg.grad_accum * 2
    assert '"gated_delta_rule": {"causal_conv1d": "torch", "chunk_gated_delta_rule": "torch"' in capsys.readouterr().out


def test_the_new_keys_are_validated_and_resume_older_checkpoints(config_factory, tmp_path):
    path = config_factory(tmp_path / "train.yaml", tmp_path / "out")
    for bad in ("gated_delta_rule=triton", "torso_init=zeros"):
        with pytest.raises(ConfigError, match=bad.split("=")[0] + " '" + bad.split("=")[1] + "' is not one of"):
            load_train_config(path, [bad])
    with pytest.raises(ConfigError, match="unknown key 'gated_delta_rules'"):
        load_train_config(path, ["gated_delta_rules=torch"])
    with pytest.raises(ConfigError, match="'compile_layers' must be bool, got 'maybe'"):
        load_train_config(path, ["compile_layers=maybe"])
    # compiling is run control, as the kernel is: a checkpoint trained without it resumes with it
    assert resume_conflicts({k: v for k, v in load_train_config(path).__dict__.items() if not k.startswith("_")},
                            load_train_config(path, ["compile_layers=true"])) == []
    cfg = load_train_config(path, ["gated_delta_rule=compiled"])
    saved = {k: v for k, v in load_train_config(path).__dict__.items() if not k.startswith("_")}
    older = {k: v for k, v in saved.items() if k not in ("torso_init", "gated_delta_rule")}
    # a kernel is run control; a checkpoint from before torso_init existed was trained on weights
    assert resume_conflicts(older, cfg) == []
    assert resume_conflicts(saved | {"torso_init": "random"}, cfg) == [
        "torso_init: checkpoint 'random', now 'pretrained'"]


def _trained(cfg, **kw) -> dict[str, torch.Tensor]:
    recipe = DeciderTrainRecipe(cfg, **kw)
    try:
        recipe.setup()
        assert recipe.train() == 0
        return {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
    finally:
        recipe.cleanup()


def test_compile_layers_runs_every_layer_through_dynamo_with_the_same_state(config_factory, tmp_path, capsys):
    """compile_layers: true compiles each decoder layer in place, under gradient checkpointing and
    beside the adapter-off frozen forward. With dynamo's ``eager`` backend (the graphs dynamo
    captures, run as captured; no code generation) one step gives
    bit for bit the state dict, same names included, of the uncompiled run: the wiring changes
    nothing but who calls the layers. What inductor's fused kernels gain is a GPU figure
    (bench/recipe_gpu.py train --set compile_layers=true)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    sets = ["gradient_checkpointing=true", "resume=false", "stop_after_steps=1"]
    path = config_factory(tmp_path / "train.yaml", tmp_path / "out")
    plain = _trained(load_train_config(path, [*sets, f"output_dir={tmp_path / 'plain'}"]))
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = _trained(load_train_config(path, [*sets, f"output_dir={tmp_path / 'compiled'}",
                                                     "compile_layers=true"]), compile_backend="eager")
        frames = counters["frames"]["ok"]
    finally:
        torch._dynamo.reset()
    layers = {k.split(".layers.")[1].split(".")[0] for k in plain if ".layers." in k}
    assert frames >= 1  # dynamo ran the layers (one graph serves every layer of a class)
    assert list(compiled) == list(plain)  # no "_orig_mod." in any name
    assert all(torch.equal(compiled[k], plain[k]) for k in plain)
    assert f'"compile_layers": {{"backend": "eager", "layers": {len(layers)}}}' in capsys.readouterr().out


def test_compile_layers_leaves_the_chunked_rule_to_its_setting(qwen35_dir):
    """In a compiled Qwen3.5 torso the Gated DeltaNet rule is a graph break (``opaque``, what the
    recipe asks for under compile_layers): it runs as gated_delta_rule says, here the torch
    function, counted on every call, so dynamo never traced into it (on a GPU: never into fla's
    triton code); the forward equals the uncompiled one bit for bit."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hobson.decider.compiling import compile_decoder_layers

    torso, _, _ = load_torso(str(qwen35_dir), dtype=torch.float32, attn_implementation="sdpa", keep_lm_head=False,
                             init="random")
    with torch.no_grad():
        ref = _forward(torso)
        torch._dynamo.reset()
        counters.clear()
        try:
            with select_gated_delta_rule(torso, "torch", "cpu", opaque=True) as choice:
                assert compile_decoder_layers(torso, backend="eager") == 4
                out = _forward(torso)
        finally:
            torch._dynamo.reset()
    assert choice.calls == LINEAR_LAYERS  # each layer's call ran, and outside the graph
    assert counters["frames"]["ok"] >= 1 and sum(counters["graph_break"].values()) >= 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_compile_layers_raises_the_graph_limit_to_cover_every_layer(monkeypatch):
    """Each transformers layer compiles to graphs of its own, so the limit must cover layers x
    variants: 30 layers ask for 240, never less than dynamo had."""
    import torch._dynamo

    from hobson.decider import compiling

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    layers = [torch.nn.Linear(2, 2) for _ in range(30)]
    monkeypatch.setattr(compiling, "decoder_layers", lambda model: layers)
    assert compiling.compile_decoder_layers(torch.nn.Sequential(*layers), backend="eager") == 30
    assert torch._dynamo.config.recompile_limit == 240
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1000)
    compiling.compile_decoder_layers(torch.nn.Sequential(*layers), backend="eager")
    assert torch._dynamo.config.recompile_limit == 1000
