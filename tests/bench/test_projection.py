"""bench/projection.py: the arithmetic of the 8-GPU projection, on figures whose answer is known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def proj():
    import projection  # bench/ is on pytest's pythonpath, as it is sys.path[0] for the scripts

    return projection


def _measured(tmp_path: Path) -> Path:
    fig = {"label": {"rows": 1000, "batched": {"rows_per_s": 100.0}}, "replay": {"rows_per_s": 200.0},
           "train": {"rows_per_s": 32.0, "torso": {"trainable_params": 1_000_000}}}
    path = tmp_path / "one_gpu.json"
    path.write_text(json.dumps(fig))
    return path


def _config(tmp_path: Path, name: str, epochs: int) -> Path:
    path = tmp_path / name
    path.write_text(f"epochs: {epochs}\nmicro_batch_size: 16\ngrad_accum: 2\n")
    return path


def test_stages_split_as_the_recipe_splits_them(proj, tmp_path):
    fig = json.loads(_measured(tmp_path).read_text())
    parent, final = _config(tmp_path, "p.yaml", 1), _config(tmp_path, "f.yaml", 2)
    r = proj.project(fig, gpus=8, scale=1, parent_cfg=parent, final_cfg=final, bandwidth_gbs=450)
    assert r["teacher"] == pytest.approx(1000 / (8 * 100))  # the array: rows split 8 ways
    assert r["replay"] == pytest.approx(1000 / (8 * 200))
    allreduce = 2 * 7 / 8 * 4e6 / 450e9  # fp32 gradients of 1 M trainable parameters, ring
    # 32 steps of 32 rows; grad_accum 2 < 8 GPUs: one micro-batch time (16 rows at 32 rows/s) per step
    assert r["parent_detail"]["steps"] == 32 and r["parent"] == pytest.approx(32 * (0.5 + allreduce))
    assert r["final_detail"]["steps"] == 63 and r["final"] == pytest.approx(63 * (0.5 + allreduce))
    assert r["all"] == pytest.approx(r["teacher"] + r["parent"] + r["replay"] + r["final"])
    one = proj.project(fig, gpus=1, scale=1, parent_cfg=parent, final_cfg=final, bandwidth_gbs=450)
    assert one["parent"] == pytest.approx(32 * 1.0) and one["parent_detail"]["allreduce_s"] == 0
    wide = proj.project(fig, gpus=8, scale=100, parent_cfg=parent, final_cfg=final, bandwidth_gbs=450, accum=8)
    assert wide["rows"] == 100_000 and wide["parent_detail"]["steps"] == 782  # ceil(100000 / 128)
    assert wide["parent"] == pytest.approx(782 * (0.5 + allreduce))


def test_main_prints_a_labelled_projection_and_refuses_missing_parts(proj, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert proj.main([str(_measured(tmp_path)), "--scales", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PROJECTION: recipe all --ngpu 8, 1,000 rows (scale 1)" in printed and "anchor 1 h 10 min" in printed
    rec = json.loads(out.read_text())
    assert rec["projection"] is True and len(rec["results"]) == 2 and rec["nvlink_gbs_assumed"] == 450
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"label": {"rows": 1}}))
    assert proj.main([str(partial)]) == 2
    assert "no figures for train, replay" in capsys.readouterr().err
