"""Providers: official names and counts on the meta device, load/export round trips, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hobson.errors import ConfigError
from hobson.models import CheckpointError, count_parameters, get_provider, tiny_config
from hobson.models.huginn import rope_table
from tests.models.conftest import FIXTURES, HUGINN, NANBEIGE, read_params


@pytest.mark.parametrize("name", [HUGINN, NANBEIGE])
def test_official_names_and_shapes_on_meta(name):
    provider = get_provider(FIXTURES / f"{name}.config.json")
    actor = provider.build_actor(FIXTURES / f"{name}.config.json", device="meta")
    produced = {k: list(v.shape) for k, v in actor.state_dict().items()}
    expected = {k: shape for k, (shape, _) in read_params(name).items()}
    assert sorted(produced) == sorted(expected)
    assert produced == expected


def test_official_parameter_counts_on_meta():
    huginn = get_provider(FIXTURES / f"{HUGINN}.config.json")
    nanbeige = get_provider(FIXTURES / f"{NANBEIGE}.config.json")
    h_actor = huginn.build_actor(FIXTURES / f"{HUGINN}.config.json", device="meta")
    assert count_parameters(h_actor) == 3_564_976_800
    assert h_actor.lm_head.weight is h_actor.transformer.wte.weight
    assert h_actor.freqs_cis.dtype == torch.float32 and list(h_actor.freqs_cis.shape) == [1, 4096, 1, 48, 2]
    cfg = FIXTURES / f"{NANBEIGE}.config.json"
    assert count_parameters(nanbeige.build_actor(cfg, device="meta")) == 4_169_800_704
    critic = nanbeige.build_critic(cfg, device="meta")
    assert count_parameters(critic) == 3_659_409_408
    assert "lm_head.weight" not in critic.state_dict() and "value_head.weight" in critic.state_dict()


def test_get_provider_sources(tmp_path):
    cfg_path = FIXTURES / f"{NANBEIGE}.config.json"
    assert get_provider(cfg_path).model_type == "nanbeige"
    assert get_provider(json.loads(cfg_path.read_text())).model_type == "nanbeige"
    assert get_provider(tiny_config("huginn_raven")).model_type == "huginn_raven"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "huginn_raven"}))
    assert get_provider(tmp_path / "m").model_type == "huginn_raven"
    with pytest.raises(ConfigError, match=r"model_type 't5' has no provider; supported: huginn_raven, nanbeige"):
        get_provider({"model_type": "t5"})
    assert get_provider({"model_type": "gpt2"}).model_type == "hf-causal-lm"  # plain HF causal LMs
    with pytest.raises(ConfigError, match="no such model directory"):
        get_provider(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="unknown model kind 'llama'"):
        tiny_config("llama")


def _stored(path):
    """{name: (dtype, shape, raw bytes)} over a model directory's safetensors files."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for n in st.keys():
                t = st.get_tensor(n)
                out[n] = (t.dtype, list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("name,dtype", [(HUGINN, torch.float32), (NANBEIGE, torch.bfloat16)])
def test_official_named_checkpoint_round_trip(tmp_path, name, dtype, request):
    ckpt_dir, tensors = request.getfixturevalue("huginn_ckpt" if name == HUGINN else "nanbeige_ckpt")
    provider = get_provider(ckpt_dir)
    model = provider.load(ckpt_dir, dtype=dtype)
    files = provider.export(model, tmp_path / "out")
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    before, after = _stored(ckpt_dir), _stored(tmp_path / "out")
    assert sorted(after) == sorted(read_params(name)) == sorted(before)
    for n in before:
        assert after[n] == before[n], n  # dtype, shape and bytes
    # sharded export too, with an index naming every tensor
    files = provider.export(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(before)
    assert _stored(tmp_path / "sharded") == before
    again = provider.load(tmp_path / "sharded", dtype=dtype)
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == provider.model_type


def test_huginn_load_keeps_tie_and_rope(huginn_ckpt):
    ckpt_dir, tensors = huginn_ckpt
    model = get_provider(ckpt_dir).load(ckpt_dir, dtype=torch.float16)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.dtype == torch.float16
    assert model.freqs_cis.dtype == torch.float32
    assert torch.equal(model.freqs_cis, tensors["freqs_cis"])


def _rewrite(ckpt_dir, name, tensor):
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    shard = ckpt_dir / index["weight_map"][name]
    with safe_open(str(shard), framework="pt") as st:
        content = {n: st.get_tensor(n) for n in st.keys()}
    content[name] = tensor
    save_file(content, str(shard), metadata={"format": "pt"})


def test_huginn_tied_alias_mismatch_refused(huginn_ckpt):
    ckpt_dir, tensors = huginn_ckpt
    head = tensors["lm_head.weight"].clone()
    head[3, 5] += 1e-3
    _rewrite(ckpt_dir, "lm_head.weight", head)
    with pytest.raises(CheckpointError, match=r"tied aliases differ: lm_head.weight \(model-0000\d-of-00002"):
        get_provider(ckpt_dir).load(ckpt_dir)


def test_huginn_wrong_freqs_cis_refused(huginn_ckpt):
    ckpt_dir, _ = huginn_ckpt
    _rewrite(ckpt_dir, "freqs_cis", rope_table(16, 64, 10000.0))  # another rope_base
    with pytest.raises(CheckpointError, match=r"freqs_cis differs from the RoPE table of this config"):
        get_provider(ckpt_dir).load(ckpt_dir)
    _rewrite(ckpt_dir, "freqs_cis", rope_table(16, 32, 50000.0))  # another block_size
    with pytest.raises(CheckpointError, match=r"freqs_cis has shape \[1, 32, 1, 8, 2\]"):
        get_provider(ckpt_dir).load(ckpt_dir)


def test_missing_and_unexpected_names_refused(nanbeige_ckpt):
    ckpt_dir, tensors = nanbeige_ckpt
    _rewrite(ckpt_dir, "model.layers.0.mlp.up_proj.weight", tensors["model.layers.0.mlp.up_proj.weight"][:5])
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight has shape \[5, 64\]"):
        get_provider(ckpt_dir).load(ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 21
    (ckpt_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unexpected 9 tensor\(s\): model.layers.21.input_layernorm"):
        get_provider(ckpt_dir).load(ckpt_dir)


@pytest.mark.parametrize("kind", ["huginn_raven", "nanbeige"])
def test_critic_from_policy_checkpoint_and_never_published(tmp_path, kind):
    provider = get_provider(tiny_config(kind))
    actor = provider.build_actor(tiny_config(kind), seed=3)
    provider.export(actor, tmp_path / "policy")
    critic = provider.load(tmp_path / "policy", critic=True, seed=5)
    trunk = {k: v for k, v in actor.state_dict().items() if k != "lm_head.weight"}
    for k, v in trunk.items():
        assert torch.equal(critic.state_dict()[k], v), k
    assert critic.value_head.weight.abs().sum() > 0
    ids = torch.randint(0, 256, (2, 5))
    kw = {"seed": 0} if kind == "huginn_raven" else {}
    assert critic(ids, **kw).shape == (2, 5)
    with pytest.raises(ValueError, match="refusing to export a critic"):
        provider.export(critic, tmp_path / "pub")
    assert not (tmp_path / "pub").exists()
    provider.export(critic, tmp_path / "critic", allow_critic=True)
    again = provider.load(tmp_path / "critic", critic=True)
    assert torch.equal(again.value_head.weight, critic.value_head.weight)


def test_export_refuses_non_empty_dir_and_is_deterministic(tmp_path):
    provider = get_provider(tiny_config("nanbeige"))
    model = provider.build_actor(tiny_config("nanbeige"), seed=1)
    provider.export(model, tmp_path / "a")
    provider.export(provider.build_actor(tiny_config("nanbeige"), seed=1), tmp_path / "b")
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    with pytest.raises(FileExistsError, match="not an empty directory"):
        provider.export(model, tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp dir left behind


def test_huginn_single_alias_checkpoint_loads(tmp_path):
    # a checkpoint saved with tied weights deduplicated (only transformer.wte.weight) and no freqs_cis
    provider = get_provider(tiny_config("huginn_raven"))
    actor = provider.build_actor(tiny_config("huginn_raven"), seed=2)
    state = {k: v for k, v in actor.state_dict().items() if k not in ("lm_head.weight", "freqs_cis")}
    (tmp_path / "m").mkdir()
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "config.json").write_text(json.dumps(actor.config.to_dict()))
    loaded = provider.load(tmp_path / "m")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for k, v in actor.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
