"""Evaluation metrics against hand-computed values, calibration on a miscalibrated toy, distill."""

from __future__ import annotations

import json
import math
import random

import pytest

from hobson.decider import metrics
from hobson.decider.calibrate import fit_temperature, fit_temperatures, mean_nll, split_half
from hobson.decider.compare import compare
from hobson.decider.distill import distill
from hobson.errors import DataError
from hobson.io import read_jsonl
from hobson.labels.shardfile import format_label_line

PROBS = [[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.8, 0.2]]
LABELS = [0, 1, 1, 0]


def test_accuracy_nll_brier_by_hand():
    assert metrics.accuracy(PROBS, LABELS) == 0.75
    # Brier: (0.01+0.01) + (0.36+0.36) + (0.09+0.09) + (0.04+0.04) = 1.0 over 4 rows
    assert metrics.brier(PROBS, LABELS) == pytest.approx(0.25, abs=1e-12)
    nll = -(math.log(0.9) + math.log(0.4) + math.log(0.7) + math.log(0.8)) / 4
    assert metrics.nll(PROBS, LABELS) == pytest.approx(nll, abs=1e-12)


def test_ece_by_hand():
    # One row per bin (0.9, 0.6, 0.7, 0.8): (|1-0.9| + |0-0.6| + |1-0.7| + |1-0.8|) / 4
    assert metrics.ece(PROBS, LABELS) == pytest.approx(0.3, abs=1e-12)
    # A fifth row shares bin [0.6, 0.7) with row 1: acc 1/2, conf 0.625 -> 2/5 * 0.125
    probs, labels = PROBS + [[0.65, 0.35]], LABELS + [0]
    assert metrics.ece(probs, labels) == pytest.approx((0.1 + 0.3 + 0.2) / 5 + 2 / 5 * 0.125, abs=1e-12)
    bins = metrics.reliability_bins(probs, labels)
    assert [b["rows"] for b in bins] == [0, 0, 0, 0, 0, 0, 2, 1, 1, 1]
    assert metrics.reliability_bins([[1.0, 0.0]], [0])[-1]["rows"] == 1  # confidence 1 is in the last bin


def test_confidence_bands_and_majority():
    bands = metrics.confidence_bands(PROBS, LABELS)
    assert [b["rows"] for b in bands] == [0, 1, 2, 1]
    assert (bands[1]["accuracy"], bands[2]["accuracy"], bands[0]["accuracy"]) == (0.0, 1.0, None)
    assert metrics.majority_baseline([2, 0, 2, 1, 0]) == (0, 0.4)  # ties: smallest position


def test_binomial_tail_by_hand_and_against_scipy():
    assert metrics.binomial_sf(8, 10, 0.5) == pytest.approx(56 / 1024, rel=1e-12)
    assert metrics.binomial_sf(0, 10, 0.3) == 1.0
    assert metrics.binomial_sf(11, 10, 0.3) == 0.0
    assert metrics.binomial_cdf(1, 7, 0.5) == pytest.approx(8 / 128, rel=1e-12)
    stats = pytest.importorskip("scipy.stats")
    for k, n, p in [(473, 1205, 0.3), (380, 1205, 0.3), (30, 100, 0.25), (700, 1205, 0.3)]:
        assert metrics.binomial_sf(k, n, p) == pytest.approx(stats.binom.sf(k - 1, n, p), rel=1e-9, abs=1e-300)


def test_summary_p_value_is_the_binomial_tail():
    s = metrics.summary([[0.9, 0.1]] * 8 + [[0.1, 0.9]] * 2, [0] * 6 + [1] * 2 + [1, 1])
    # majority position 0 (6 of 10), correct 6 + 0 + 2 = 8
    assert (s["correct"], s["majority_accuracy"]) == (8, 0.6)
    assert s["p_beats_majority"] == pytest.approx(metrics.binomial_sf(8, 10, 0.6))


def test_mcnemar_exact_by_hand():
    a = [True] * 6 + [False] * 1 + [True] * 3
    b = [False] * 6 + [True] * 1 + [True] * 3
    r = metrics.mcnemar_exact(a, b)
    assert (r["only_a"], r["only_b"]) == (6, 1)
    assert r["p_value"] == pytest.approx(2 * 8 / 128, rel=1e-12)  # 2 P(X <= 1), X ~ Bin(7, 1/2)
    assert metrics.mcnemar_exact([True, False], [True, False])["p_value"] == 1.0
    assert metrics.mcnemar_exact([True] * 10, [False] * 10)["p_value"] == pytest.approx(2 / 1024)


def test_compare_pairs_rows_by_index_and_refuses_other_rows():
    def preds(right):
        return {i: {"index": i, "task": "t" if i < 5 else "u", "label": 0, "pred": 0 if ok else 1}
                for i, ok in enumerate(right)}
    a = preds([True] * 10)
    b = preds([False] * 4 + [True] * 6)
    r = compare(a, b)
    assert r["overall"]["only_a"] == 4 and r["overall"]["p_value"] == pytest.approx(2 / 16)
    assert r["per_task"]["t"]["rows"] == 5 and r["per_task"]["u"]["only_a"] == 0
    del b[3]
    with pytest.raises(DataError, match="different rows"):
        compare(a, b)


def _toy(n=600, k=4, seed=0):
    rng = random.Random(seed)
    logits, rows = [], []
    for _ in range(n):
        z = [rng.gauss(0, 1) for _ in range(k)]
        w = [math.exp(x) for x in z]
        y = rng.choices(range(k), weights=w)[0]
        logits.append([4.0 * x for x in z])  # 4x overconfident
        rows.append({"kind": "choice" if len(rows) % 3 else "noul", "label": y})
    return logits, rows


def test_calibration_lowers_nll_on_an_overconfident_toy():
    logits, rows = _toy()
    labels = [r["label"] for r in rows]
    t = fit_temperature(logits, labels)
    assert 3.0 < t < 5.5
    assert mean_nll(logits, labels, t) < mean_nll(logits, labels, 1.0) - 0.2
    temps = fit_temperatures(logits, rows, min_kind_rows=250)
    assert set(temps["per_kind"]) == {"choice"}  # noul has 200 rows < 250: it uses the global one
    assert temps["calibration"]["nll_after"] < temps["calibration"]["nll_before"]
    # A calibrated model keeps T = 1.
    calibrated = [[x / 4.0 for x in z] for z in logits]
    assert abs(fit_temperature(calibrated, labels) - 1.0) < 0.25


def test_halves_split_by_position():
    assert split_half(5, "calib") == [0, 2, 4]
    assert split_half(5, "test") == [1, 3]
    assert sorted(split_half(7, "calib") + split_half(7, "test")) == split_half(7, "all")


def test_distill_keeps_teacher_rows_that_agree_with_gold_then_appends_replay(decider_data, tmp_path):
    rows = read_jsonl(decider_data["train"])
    teacher, replay, want = tmp_path / "teacher_train.jsonl", tmp_path / "replay_train.jsonl", []
    t_lines, r_lines = [], []
    for i in range(0, 12):
        n = len(rows[i]["options"])
        gold = rows[i]["label"]
        agree = i % 3 != 0
        top = gold if agree else (gold + 1) % n
        probs = [0.5 if j == top else 0.5 / (n - 1) for j in range(n)]
        t_lines.append(format_label_line(i, probs))
        if agree:
            want.append(t_lines[-1])
    for i in range(0, 15):  # replay covers rows the teacher never labelled, too
        n = len(rows[i]["options"])
        r_lines.append(format_label_line(i, [1.0 / n] * n))
    want += [line for i, line in enumerate(r_lines) if not (i < 12 and i % 3 != 0)]
    teacher.write_text("".join(t_lines))
    replay.write_text("".join(r_lines))
    out = tmp_path / "final_teacher.jsonl"
    r = distill([str(decider_data["train"])], [str(teacher)], [str(replay)], out)
    assert out.read_text() == "".join(want)
    assert (r.teacher_rows, r.teacher_kept, r.replay_rows, r.replay_appended) == (12, 8, 15, 7)
    assert r.rows == 15 and len({json.loads(x)["i"] for x in want}) == 15
    bad = tmp_path / "bad.jsonl"
    bad.write_text(format_label_line(10_000, [1.0]))
    with pytest.raises(DataError, match="bad.jsonl:1: i=10000 is outside"):
        distill([str(decider_data["train"])], [str(bad)], [], tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("job", ["replay", "distill", "calibrate", "evaluate", "compare", "soup", "ask", "release"])
def test_job_help_explains_every_flag(job, capsys):
    import importlib

    mod = importlib.import_module(f"hobson.jobs.{job}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m jobs.{job}" in out
    for action in mod._parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{job}: {action.option_strings} has no help"


def test_calibrate_writes_temperatures_in_place_atomically(tmp_path):
    from hobson.decider.calibrate import write_temperatures
    from hobson.decider.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path / "ck", config={"a": 1}, adapter={}, head={})
    write_temperatures(tmp_path / "ck", {"global": 1.5, "per_kind": {"score": 0.7}})
    assert load_checkpoint(tmp_path / "ck").temperatures == {"global": 1.5, "per_kind": {"score": 0.7}}
    assert sorted(p.name for p in (tmp_path).iterdir()) == ["ck"]  # no temp files left
    with pytest.raises(DataError, match="not a decider checkpoint"):
        write_temperatures(tmp_path / "nope", {"global": 1.0, "per_kind": {}})
