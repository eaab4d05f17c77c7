"""The RL raises held-out reward: each tiny looped model, started from its supervised arithmetic
checkpoint, answers more held-out prompts correctly after RL, by an exact one-sided sign test on
the prompts whose greedy outcome changed (one pair per model here; the four algorithms x two
models, with the start checkpoints built from nothing: bench/rl_learning.py).

The trials start from the shipped start checkpoints (``src/hobson/rl/start``, built by this
recipe from nothing with ``python -m hobson.rl.arithmetic --ship``): a test here fails when the
recipe changes without them being rebuilt, and another runs the recipe's code path itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hobson.rl import arithmetic
from hobson.rl.evaluate import evaluate, sign_test, write_report

UPDATES = arithmetic.LEARNING["nanbeige"]["updates"]


def test_split_shares_no_operands_and_operator() -> None:
    train, held = arithmetic.split()
    assert len(held) == arithmetic.HELD_OUT and len(train) + len(held) == arithmetic.OPERANDS**2 * len(arithmetic.OPS)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert held[0]["prompt"].startswith("What is ") and held[0]["prompt"].endswith("Answer with \\boxed{}.")


def test_sign_test_is_exact() -> None:
    assert sign_test([0, 0, 0, 1], [1, 1, 1, 1]) == (3, 0, 0.125)
    up, down, p = sign_test([0] * 10 + [1] * 2, [1] * 10 + [0] * 2)
    assert (up, down) == (10, 2) and p == pytest.approx(79 / 4096)  # P(X >= 10), X ~ Bin(12, 1/2)


@pytest.mark.parametrize("kind", sorted(arithmetic.SFT_KIND))
def test_shipped_start_checkpoints_are_this_recipes_and_verify(kind: str, tmp_path: Path) -> None:
    assert arithmetic.shipped_problem(kind) is None  # else: python -m hobson.rl.arithmetic --ship
    card = json.loads((arithmetic.SHIPPED / kind / arithmetic.CARD).read_text())
    assert card["sft"] == arithmetic.sft_settings(kind) and card["torch"] and card["cpu"]
    # a copy with one flipped byte is refused by name, and start_checkpoint would build instead
    copy = tmp_path / kind
    shutil.copytree(arithmetic.SHIPPED / kind, copy)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    problem = arithmetic.shipped_problem(kind, tmp_path)
    assert problem is not None and weights.name in problem and "sha256" in problem


@pytest.mark.parametrize("kind", sorted(arithmetic.SFT_KIND))
def test_the_start_recipe_is_deterministic_and_exports_a_loadable_model(kind: str, tmp_path: Path) -> None:
    # the code path of --ship and of the bench's build from nothing, for 3 steps: the same bytes twice
    states = []
    for i in range(2):
        with arithmetic.threads(arithmetic.THREADS):
            provider, model = arithmetic.train_start_model(kind, lambda s: None, steps=3)
        provider.export(model, tmp_path / str(i))
        states.append(model.state_dict())
    for name, t in states[0].items():
        assert torch.equal(t, states[1][name]), name
    shipped = {p.name for p in (arithmetic.SHIPPED / kind).iterdir()} - {arithmetic.CARD, "manifest.json"}
    assert {p.name for p in (tmp_path / "0").iterdir()} == shipped
    loaded = provider.load(tmp_path / "0").state_dict()
    assert loaded.keys() == states[0].keys()
    for name, t in loaded.items():
        assert torch.equal(t, states[0][name]), name


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # GRPO on the Nanbeige-shaped model at the bench's settings: 32 prompts x 4 completions
    root = tmp_path_factory.mktemp("learn")
    return arithmetic.learning_trial("nanbeige", "grpo", root, curve_every=UPDATES, echo=lambda s: None)


def test_start_checkpoint_answers_in_the_format_with_room_to_learn(trial: dict) -> None:
    assert trial["boxed_before"] >= 0.95
    assert 0.05 <= trial["reward_before"] <= 0.8


def test_grpo_improves_held_out_accuracy(trial: dict, tmp_path: Path) -> None:
    assert trial["after"] > trial["before"]
    assert trial["p"] < 0.01, trial
    # the user's command on the same run: one JSON and one PNG, the same numbers
    from hobson.jobs.rl_eval import main

    held = Path(trial["run"]).parent / "data" / "held_out.jsonl"
    assert main([trial["run"], "--data", str(held), "--versions", "0", str(UPDATES), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "rl_eval.json").read_text())["versions"]
    assert [r["accuracy"] for r in rows] == [trial["before"], trial["after"]]
    assert (tmp_path / "rl_eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = evaluate(trial["run"], held, versions=[UPDATES], echo=lambda s: None)
    assert again[0].correct == json.loads((tmp_path / "rl_eval.json").read_text())["versions"][1]["correct"]
    write_report(again, tmp_path / "one")


@pytest.fixture(scope="module")
def huginn_trial(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # Flow-DPPO on the Huginn-shaped model at the bench's settings: 32 prompts x 1 completion
    root = tmp_path_factory.mktemp("learn-huginn")
    return arithmetic.learning_trial("huginn_raven", "flow-dppo", root,
                                     curve_every=arithmetic.LEARNING["huginn_raven"]["updates"], echo=lambda s: None)


@pytest.mark.slow
def test_huginn_flow_dppo_improves_held_out_accuracy(huginn_trial: dict) -> None:
    """Slow (~35 s on 2 cores): 50 RL updates of the Huginn-shaped model through its 4
    recurrences, then two greedy evaluations of the 200 held-out prompts; at 30 updates PPO's gain
    on this model was within p 0.017 on one CPU, so the bench and this test run 50."""
    assert huginn_trial["boxed_before"] >= 0.95 and 0.05 <= huginn_trial["reward_before"] <= 0.8
    assert huginn_trial["after"] > huginn_trial["before"]
    assert huginn_trial["p"] < 0.01, huginn_trial
