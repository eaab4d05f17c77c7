"""Plain HF causal LMs through the RL loop (tiny random Qwen3 with a tied embedding, tiny Llama
untied; CPU, fp32): bit-exact resume for GRPO and PPO, engine/trainer log-prob agreement, and
export/load keeping the HF names and tensors.

The resume runs mirror tests/rl/test_rl_resume.py: the TEST-ONLY ``test-token-value`` reward and
lr 0.1 (non-zero advantages, weights that change at every update), the uninterrupted and the
stopped runs in the pytest process, both resumes in ONE fresh process, threads pinned to 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hobson.errors import ConfigError
from hobson.io import sha256_file
from hobson.models import CheckpointError, get_provider
from hobson.models.hf import HFCausalLMProvider
from hobson.rl import checkpoint as ckpt
from hobson.rl.loop import build_batch
from hobson.rl.objectives import token_logprobs
from hobson.rl.verify_resume import compare_runs
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine, request_seed
from tests.rl.resume_runs import COMMON, full_stop_resume

PROVIDER = HFCausalLMProvider()
# PPO also runs with --recompute: HF activation checkpointing in actor and critic
ALGORITHMS = {"grpo": [], "ppo": ["--recompute"]}


def _qwen3():
    return PROVIDER.tiny_config()  # Qwen3, vocabulary 256 (the byte tokenizer), tied embedding


def _llama():
    return PROVIDER.tiny_config("llama")  # untied lm_head


def _hf_dir(path: Path, cfg, seed: int = 3) -> Path:
    """A real HF checkpoint directory (``save_pretrained``: a tied lm_head is not stored)."""
    PROVIDER.build_actor(cfg, seed=seed).net.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("hf") / "qwen3-tiny", _qwen3())


def _args(alg: str, model: Path, out: Path) -> list[str]:
    return ["--algorithm", alg, "--model", str(model), "--output", str(out), *COMMON, *ALGORITHMS[alg]]


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-rl-resume")
    full_stop_resume(
        [
            (_args(alg, model_dir, root / f"{alg}-full"), _args(alg, model_dir, root / f"{alg}-part"))
            for alg in ALGORITHMS
        ],
        timeout=600,
    )
    return root


def _names(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("alg", list(ALGORITHMS))
def test_hf_resume_is_bit_exact(runs: Path, model_dir: Path, alg: str) -> None:
    full, part = runs / f"{alg}-full", runs / f"{alg}-part"
    items = compare_runs(full, part)
    bad = [i.line() for i in items if i.difference is not None]
    assert not bad, bad
    names = " ".join(i.name for i in items)
    for what in (
        "actor parameters",
        "critic parameters",
        "optimizer state",
        "RNG state",
        "tokens",
        "behaviour log-probs",
        "rewards",
        "publication v000003 digest",
        "checkpoint update-000003",
    ):
        assert what in names

    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(r["adv_abs_mean"] > 0 for r in rows), [r["adv_abs_mean"] for r in rows]
    assert all(r["logprob_diff_max"] < 3e-6 for r in rows), [r["logprob_diff_max"] for r in rows]
    digests = [
        json.loads((full / "publications" / f"v{v:06d}" / "manifest.json").read_text())["digest"] for v in range(4)
    ]
    assert len(set(digests)) == 4  # the weights change at every update

    # publications and checkpoints keep the HF names; the tied head is published as a copy, the
    # critic (torso + value_head, no LM head) never
    ckpt3 = full / "checkpoints" / "update-000003"
    state3 = ckpt.load_checkpoint(ckpt3)
    # the publication holds the actor's exact state dict: the checkpoint reads its actor from it
    assert state3["actor_publication"] == "publications/v000003" and not (ckpt3 / "actor.safetensors").exists()
    actor_names = sorted(state3["actor"])
    assert _names(full / "publications" / "v000003" / "model.safetensors") == actor_names
    assert "lm_head.weight" in actor_names and "model.embed_tokens.weight" in actor_names
    pub = load_file(str(full / "publications" / "v000003" / "model.safetensors"))
    assert torch.equal(pub["lm_head.weight"], pub["model.embed_tokens.weight"])
    assert not any("value_head" in n for n in actor_names)
    manifest = json.loads((full / "publications" / "v000003" / "manifest.json").read_text())
    assert manifest["model_type"] == "qwen3" and manifest["dtype"] == "float32"
    if alg == "ppo":
        critic_names = _names(ckpt3 / "critic.safetensors")
        assert set(critic_names) == (set(actor_names) - {"lm_head.weight"}) | {"value_head.weight"}
    else:
        assert not (ckpt3 / "critic.safetensors").exists()

    sessions = json.loads((part / "run.json").read_text())["rl"]["sessions"]
    first, resumed = sessions
    assert first["updates_run"] == [1, 2] and first["stopped_after"] == 2
    assert resumed["resumed_from"] == "checkpoints/update-000002"
    assert resumed["updates_run"] == [3]
    ev = resumed["events"]
    assert ev[0]["event"] == "load_checkpoint" and ev[0]["update"] == 2
    assert ev[1]["event"] == "publish" and ev[1]["version"] == 2 and ev[1]["digest"] == digests[2]
    assert ev[2] == {"event": "rollout", "update": 3, "version": 2}
    assert [e["event"] for e in ev].count("update") == 1
    assert resumed["pid"] != first["pid"]


@pytest.mark.parametrize("make", [_qwen3, _llama], ids=["qwen3-tied", "llama-untied"])
def test_hf_engine_and_trainer_logprobs_agree(tmp_path: Path, make) -> None:
    actor = PROVIDER.build_actor(make(), seed=3)
    root = tmp_path / "publications"
    man = publication.publish(
        PROVIDER, actor, root, 0, model_revision="rev-a", engine_revision="eng", dtype=torch.float32
    )
    engine = NativeEngine(
        PROVIDER, dtype=torch.float32, device="cpu", eos_id=0, pad_id=0, model_revision="rev-a", engine_revision="eng"
    )
    engine.load_publication(publication.version_dir(root, 0))
    # prompts of different lengths: the engine left-pads (KV cache, growing key mask), the
    # trainer right-pads (one full forward)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    seeds = [request_seed(42, 0, i) for i in range(3)]
    outs = engine.generate(prompts, seeds, temperature=0.8, max_new_tokens=10)
    assert all(o.version == 0 and o.digest == man.digest and o.trace is None for o in outs)
    batch = build_batch(prompts, outs, [0.0] * 3, [0, 1, 2], seeds, pad_id=0)
    with torch.no_grad():
        logits = actor(batch.ids)[:, :-1]
    assert logits.dtype == torch.float32 and logits.shape == (3, batch.ids.shape[1] - 1, 256)
    lp = token_logprobs(logits, batch.actions, 0.8)
    diff = (lp - batch.behav).abs()[batch.mask.bool()]
    assert diff.numel() == sum(len(o.tokens) for o in outs)
    assert float(diff.max()) < 3e-6, float(diff.max())
    # a request alone gives the same completion (per-request generators, per-row positions)
    alone = engine.generate([prompts[1]], [seeds[1]], temperature=0.8, max_new_tokens=10)[0]
    assert alone.tokens == outs[1].tokens


def test_hf_export_load_round_trip_tied(tmp_path: Path) -> None:
    src = _hf_dir(tmp_path / "hf", _qwen3())
    assert "lm_head.weight" not in _names(src / "model.safetensors")  # HF stores a tied head once
    assert isinstance(get_provider(src), HFCausalLMProvider)
    model = PROVIDER.load(src)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    stored = load_file(str(src / "model.safetensors"))
    state = model.state_dict()
    assert set(state) == set(stored) | {"lm_head.weight"}
    assert all(torch.equal(state[n], t) for n, t in stored.items())

    PROVIDER.export(model, tmp_path / "a")
    exported = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert sorted(exported) == sorted(state)  # the HF names, the tied head written as its own copy
    assert torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "qwen3"
    again = PROVIDER.load(tmp_path / "a")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert list(again.state_dict()) == list(state)
    assert all(torch.equal(again.state_dict()[n], t) for n, t in state.items())
    PROVIDER.export(again, tmp_path / "b")
    assert sha256_file(tmp_path / "b" / "model.safetensors") == sha256_file(tmp_path / "a" / "model.safetensors")

    # the critic: same torso, value_head instead of the LM head; never exported as a policy
    critic = PROVIDER.load(src, critic=True, seed=7)
    assert set(critic.state_dict()) == set(stored) | {"value_head.weight"}
    assert all(torch.equal(critic.state_dict()[n], t) for n, t in stored.items())
    assert critic(torch.tensor([[5, 6, 7]])).shape == (1, 3)
    with pytest.raises(ValueError, match="refusing to export a critic"):
        PROVIDER.export(critic, tmp_path / "c")
    PROVIDER.export(critic, tmp_path / "c", allow_critic=True)
    back = PROVIDER.load(tmp_path / "c", critic=True, seed=99)
    assert torch.equal(back.value_head.weight, critic.value_head.weight)

    # refused, naming what is wrong
    bad = dict(exported)
    bad["lm_head.weight"] = bad["lm_head.weight"] + 1
    save_file(bad, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tied aliases differ: lm_head.weight"):
        PROVIDER.load(tmp_path / "a")
    save_file({n: t for n, t in stored.items() if n != "model.norm.weight"}, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.norm.weight"):
        PROVIDER.load(src)
    save_file({**stored, "extra.weight": torch.zeros(2)}, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor\(s\): extra.weight"):
        PROVIDER.load(src)
    with pytest.raises(ConfigError, match="model_type 't5' has no provider"):
        get_provider({"model_type": "t5"})


def test_hf_recompute_gives_the_same_gradients() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    for critic in (False, True):
        build = PROVIDER.build_critic if critic else PROVIDER.build_actor
        model = build(_qwen3(), seed=1).train()
        grads = []
        for on in (False, True):
            model.gradient_checkpointing = on
            model.zero_grad(set_to_none=True)
            model(ids).pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        layers = model.model.layers
        assert all(layer.gradient_checkpointing for layer in layers)  # HF's checkpointing is on
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
