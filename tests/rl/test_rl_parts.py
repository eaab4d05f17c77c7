"""The RL pieces on tiny CPU models: engine/trainer agreement, publications, refusals, data, rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hobson.errors import ConfigError, DataError, DigestMismatch
from hobson.jobs.rl import main
from hobson.models import CheckpointError, get_provider, tiny_config
from hobson.rl.data import load_prompts
from hobson.rl.loop import build_batch
from hobson.rl.objectives import token_logprobs
from hobson.rl.reward import get_reward
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine, request_seed

KINDS = ["huginn_raven", "nanbeige"]


def _published(tmp_path: Path, kind: str, dtype: torch.dtype = torch.float32):
    cfg = tiny_config(kind)
    provider = get_provider(cfg)
    actor = provider.build_actor(cfg, seed=3)
    root = tmp_path / "publications"
    man = publication.publish(provider, actor, root, 0, model_revision="rev-a", engine_revision="eng", dtype=dtype)
    return provider, actor, root, man


def _engine(provider, dtype: torch.dtype = torch.float32) -> NativeEngine:
    return NativeEngine(
        provider, dtype=dtype, device="cpu", eos_id=0, pad_id=0, model_revision="rev-a", engine_revision="eng"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_engine_and_trainer_logprobs_agree(tmp_path: Path, kind: str) -> None:
    provider, actor, root, man = _published(tmp_path, kind)
    engine = _engine(provider)
    engine.load_publication(publication.version_dir(root, 0))
    # prompts of different lengths: the engine left-pads, the trainer right-pads
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    seeds = [request_seed(42, 0, i) for i in range(3)]
    outs = engine.generate(prompts, seeds, temperature=0.8, max_new_tokens=10)
    assert all(o.version == 0 and o.digest == man.digest for o in outs)
    if kind == "huginn_raven":
        assert outs[0].trace == {
            "seed": seeds[0],
            "profile": "like-init-cpu-f32-v1",
            "check": "seed 0, position 0, width 16: -0.743694 -0.572633 0.006496 -1.557992",
            "depths": [4] * len(outs[0].tokens),
            "model_revision": "rev-a",
            "policy_version": 0,
        }
    else:
        assert outs[0].trace is None
    batch = build_batch(prompts, outs, [0.0] * 3, [0, 1, 2], seeds, pad_id=0)
    from hobson.rollout.engine import forward_kwargs

    with torch.no_grad():
        logits = actor(batch.ids, **forward_kwargs(actor, seeds, 0))[:, :-1]
    lp = token_logprobs(logits, batch.actions, 0.8)
    diff = (lp - batch.behav).abs()[batch.mask.bool()]
    assert diff.numel() == sum(len(o.tokens) for o in outs)
    assert float(diff.max()) < 3e-6, float(diff.max())
    # the same request alone gives the same completion (per-request generators, per-row latents)
    alone = engine.generate([prompts[1]], [seeds[1]], temperature=0.8, max_new_tokens=10)[0]
    assert alone.tokens == outs[1].tokens


def test_flipped_byte_is_refused(tmp_path: Path) -> None:
    provider, actor, root, man = _published(tmp_path, "huginn_raven")
    engine = _engine(provider)
    engine.load_publication(publication.version_dir(root, 0))
    actor2 = provider.build_actor(tiny_config("huginn_raven"), seed=4)
    publication.publish(provider, actor2, root, 1, model_revision="rev-a", engine_revision="eng", dtype=torch.float32)
    weights = publication.version_dir(root, 1) / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x01  # a byte of the last tensor's data
    weights.write_bytes(bytes(raw))
    with pytest.raises(DigestMismatch, match="refusing version 1"):
        engine.load_publication(publication.version_dir(root, 1))
    assert engine.version == 0 and engine.digest == man.digest and not engine.paused  # still serving v0
    with pytest.raises(DigestMismatch, match="refusing version 1"):
        publication.verify(publication.version_dir(root, 1))


def _tamper(pub: Path, edit) -> None:
    """Change tensors and re-sign the manifest, so only the model checks can catch it."""
    path = pub / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    man = json.loads((pub / "manifest.json").read_text())
    man["digest"] = publication.tensors_digest(tensors)
    (pub / "manifest.json").write_text(json.dumps(man))


def test_tied_alias_mismatch_is_refused(tmp_path: Path) -> None:
    provider, _, root, _ = _published(tmp_path, "huginn_raven")
    pub = publication.version_dir(root, 0)

    def edit(t: dict) -> None:
        t["lm_head.weight"] = t["lm_head.weight"].clone()
        t["lm_head.weight"][0, 0] += 1.0

    _tamper(pub, edit)
    publication.verify(pub)  # the digest itself is consistent
    with pytest.raises(CheckpointError, match="tied aliases differ"):
        _engine(provider).load_publication(pub)


def test_rope_mismatch_is_refused(tmp_path: Path) -> None:
    provider, _, root, _ = _published(tmp_path, "huginn_raven")
    pub = publication.version_dir(root, 0)

    def edit(t: dict) -> None:
        t["freqs_cis"] = t["freqs_cis"].clone()
        t["freqs_cis"][0, 5, 0, 1, 0] += 0.01

    _tamper(pub, edit)
    with pytest.raises(CheckpointError, match="differs from the RoPE table"):
        _engine(provider).load_publication(pub)


def test_precision_and_revision_mismatch_are_refused(tmp_path: Path) -> None:
    provider, _, root, _ = _published(tmp_path, "nanbeige", dtype=torch.float16)
    with pytest.raises(ConfigError, match="published in float16, this engine runs float32"):
        _engine(provider).load_publication(publication.version_dir(root, 0))
    other = NativeEngine(
        provider, dtype=torch.float16, device="cpu", eos_id=0, pad_id=0, model_revision="rev-b", engine_revision="eng"
    )
    with pytest.raises(ConfigError, match="model revision 'rev-a'"):
        other.load_publication(publication.version_dir(root, 0))
    with pytest.raises(ConfigError, match="rollout and training must use the same precision"):
        from hobson.rl.config import RLConfig

        RLConfig(precision="fp32", rollout_precision="fp16")


def test_publication_versions(tmp_path: Path) -> None:
    provider, actor, root, man = _published(tmp_path, "nanbeige")
    pub = publication.version_dir(root, 0)
    assert sorted(p.name for p in pub.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    assert man.dtype == "float32" and man.model_revision == "rev-a" and man.engine_revision == "eng"
    # republishing the same weights under an existing version is a no-op; other weights are refused
    assert (
        publication.publish(
            provider, actor, root, 0, model_revision="rev-a", engine_revision="eng", dtype=torch.float32
        ).digest
        == man.digest
    )
    critic = provider.build_critic(tiny_config("nanbeige"))
    with pytest.raises(ValueError, match="critic"):
        publication.publish(
            provider, critic, root, 1, model_revision="rev-a", engine_revision="eng", dtype=torch.float32
        )
    other = provider.build_actor(tiny_config("nanbeige"), seed=9)
    with pytest.raises(DigestMismatch, match="version 0 exists"):
        publication.publish(
            provider, other, root, 0, model_revision="rev-a", engine_revision="eng", dtype=torch.float32
        )
    with pytest.raises(publication.PublicationError, match="does not follow"):
        publication.publish(
            provider, other, root, 2, model_revision="rev-a", engine_revision="eng", dtype=torch.float32
        )
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_bad_data_rows_name_the_line(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "label": "1"}\n{"prompt": 3, "label": "1"}\n')
    with pytest.raises(DataError, match=rf"^{f}:2: 'prompt' must be a string, got int$"):
        load_prompts(f)
    f.write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=rf"^{f}:1: missing 'label'"):
        load_prompts(f)
    f.write_text('["a", "b"]\n')
    with pytest.raises(DataError, match=rf"^{f}:1: expected an object"):
        load_prompts(f)


def test_math_reward() -> None:
    reward = get_reward("math")
    assert reward("so the answer is \\boxed{32}.", [], "32") == 1.0
    assert reward("\\boxed{1/2}", [], "0.5") == 1.0
    assert reward("\\boxed{31}", [], "32") == 0.0
    assert reward("32", [], "32") == 0.0
    with pytest.raises(ConfigError, match="unknown reward 'nope'; supported: math, test-constant, test-token-value"):
        get_reward("nope")


TINY = ["--max-new-tokens", "4", "--prompts-per-update", "2", "--completions-per-prompt", "2"]


def test_grpo_equal_rewards_change_nothing(tmp_path: Path) -> None:
    out = tmp_path / "grpo"
    assert (
        main(
            [
                "--algorithm",
                "grpo",
                "--model",
                "tiny:nanbeige",
                "--output",
                str(out),
                "--reward",
                "test-constant",
                "--updates",
                "1",
                "--lr",
                "0.5",
                *TINY,
            ]
        )
        == 0
    )
    row = json.loads((out / "metrics.jsonl").read_text())
    assert row["adv_abs_mean"] == 0.0 and row["grad_norm"] == 0.0 and row["loss"] == 0.0
    # the update's wall time and the share outside rollout and optimization (publish, checkpoint, ...)
    sec = row["seconds"]
    assert sec["update"] >= sec["rollout"] + sec["train"] > 0
    assert 0 <= row["outside_share"] < 1
    assert abs(row["outside_share"] - (1 - (sec["rollout"] + sec["train"]) / sec["update"])) < 1e-2
    digests = [
        json.loads((out / "publications" / v / "manifest.json").read_text())["digest"] for v in ("v000000", "v000001")
    ]
    assert digests[0] == digests[1]  # unchanged weights
    assert all(
        r["advantage"] == 0.0
        for r in map(json.loads, (out / "rollouts" / "update-000001.jsonl").read_text().splitlines())
    )
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_refuses_changed_settings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = [
        "--algorithm",
        "grpo",
        "--model",
        "tiny:nanbeige",
        "--output",
        str(out),
        "--data",
        str(data),
        "--reward",
        "test-token-value",
        "--updates",
        "2",
        *TINY,
    ]
    assert main([*base, "--stop-after", "1"]) == 0
    assert main([*base, "--stop-after", "1"]) == 1  # a second fresh start into the same output
    assert "already holds a run" in capsys.readouterr().err
    assert (
        main(
            [
                *base[:-8],
                "--updates",
                "3",
                *TINY,
                "--precision",
                "fp16",
                "--device",
                "cuda",
                "--train-env-vars",
                "A=1",
                "--resume",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "--resume refuses settings that differ" in err
    assert "precision: run has 'fp32', this call 'fp16'" in err
    assert "device: run has 'cpu', this call 'cuda'" in err
    assert "updates: run has 2, this call 3" in err
    assert "train_env_vars: run has [], this call ['A=1']" in err
    data.write_text('{"prompt": "1+2=", "label": "3"}\n')
    assert main([*base, "--resume"]) == 1
    assert "data_sha256: run has" in capsys.readouterr().err


def test_model_revision_checked_against_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tiny_config("nanbeige")
    provider = get_provider(cfg)
    model = tmp_path / "model"
    provider.export(provider.build_actor(cfg), model)
    (model / "revision.txt").write_text("abc123\n")
    args = ["--model", str(model), "--output", str(tmp_path / "o"), "--model-revision", "def456"]
    assert main(args) == 1
    assert "--model-revision def456 but" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_resume_refuses_another_latent_profile(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "huginn"
    base = [
        "--algorithm",
        "grpo",
        "--model",
        "tiny:huginn_raven",
        "--output",
        str(out),
        "--reward",
        "test-token-value",
        "--updates",
        "2",
        *TINY,
    ]
    assert main([*base, "--stop-after", "1"]) == 0
    meta = json.loads((out / "run.json").read_text())
    profile = meta["rl"]["latent_profile"]
    assert profile["profile"] == "like-init-cpu-f32-v1" and profile["dtype"] == "float32"
    assert profile["torch"] == torch.__version__ and profile["machine"]
    meta["rl"]["latent_profile"]["torch"] = "0.0.0"
    (out / "run.json").write_text(json.dumps(meta))
    assert main([*base, "--resume"]) == 1
    err = capsys.readouterr().err
    assert (
        f"latent profile differs, replayed log-probs would not match: torch: recorded '0.0.0', now "
        f"'{torch.__version__}'" in err
    )


def test_shipped_rl_configs_load() -> None:
    from hobson.config import load_config
    from hobson.rl.config import RLConfig

    root = Path(__file__).resolve().parents[2] / "configs" / "rl"
    names = sorted(p.stem for p in root.glob("*.yaml"))
    assert names == ["dppo", "flow-dppo", "grpo", "ppo"]
    for name in names:
        cfg = load_config(root / f"{name}.yaml", RLConfig)
        assert cfg.algorithm == name and cfg.optimizer == "SGD" and cfg.lr == 1e-5 and cfg.trainer == "deepspeed"
        assert (cfg.prompts_per_update, cfg.max_prompt_tokens, cfg.max_new_tokens, cfg.temperature, cfg.seed) == (
            4,
            128,
            48,
            0.8,
            42,
        )
