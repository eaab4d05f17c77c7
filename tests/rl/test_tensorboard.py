"""RL metrics go to TensorBoard too: every scalar of metrics.jsonl is in <output>/tb with the
same values, and a resumed run that recomputes updates past its checkpoint leaves each step once."""

from __future__ import annotations

import json
import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hobson.jobs.rl import main

ARGS = ["--algorithm", "ppo", "--updates", "3", "--device", "cpu", "--reward", "test-token-value",
        "--max-new-tokens", "4", "--prompts-per-update", "2", "--lr", "0.1"]


def _scalars(tb) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_every_metric_in_tensorboard_once_after_a_resume(tmp_path):
    out = tmp_path / "run"
    assert main([*ARGS, "--output", str(out)]) == 0
    # the newest checkpoint lost: the resume recomputes update 3, whose row the first process logged
    shutil.rmtree(out / "checkpoints" / "update-000003")
    assert main([*ARGS, "--output", str(out), "--resume"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    got = _scalars(out / "tb")
    for key in ("reward_mean", "approx_kl", "clipfrac", "entropy", "loss", "value_loss", "grad_norm",
                "tokens_per_s", "adv_abs_mean", "seconds/rollout", "seconds/checkpoint"):
        assert key in got, sorted(got)
        steps = [s for s, _ in got[key]]
        assert steps == [1, 2, 3], (key, got[key])  # each step once: the first process's 3 purged
        want = [r[key] if "/" not in key else r["seconds"][key.split("/")[1]] for r in rows]
        # TensorBoard keeps float32: equal to the JSONL's value to float32 precision
        assert [v for _, v in got[key]] == pytest.approx(want, rel=1e-6, abs=1e-12), key
