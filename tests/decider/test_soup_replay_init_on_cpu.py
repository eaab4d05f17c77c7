"""Replay shards merge byte-identically, soups are mean models, init_from fixes its keys, evaluation.

Three real fine-tunes of the tiny torso (tests/decider/conftest.py; seeds 0, 1, 2; one epoch of 5
optimizer steps each) are trained once per module and shared by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from hobson.decider.checkpoint import load_checkpoint
from hobson.decider.config import load_train_config
from hobson.decider.predict import DeciderScorer, load_decider
from hobson.decider.soup import soup_checkpoints
from hobson.decider.train import DeciderTrainRecipe, recipe_main
from hobson.errors import ConfigError
from hobson.io import read_jsonl
from hobson.labels import label_rows, merge_shards


@pytest.fixture(scope="module")
def finetunes(config_factory, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("finetunes")
    out = []
    for seed in (0, 1, 2):
        cfg = config_factory(root / f"s{seed}.yaml", root / f"s{seed}", seed=seed, epochs=1, kl_frozen_weight=0.0)
        assert recipe_main(load_train_config(cfg)) == 0
        out.append(root / f"s{seed}" / "final")
    return out


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
def test_replay_shards_merge_byte_identical_to_one_process(finetunes, decider_data, tmp_path, num_shards):
    rows = read_jsonl(decider_data["train"])
    scorer = DeciderScorer(load_decider(finetunes[0]))
    ref = tmp_path / "ref" / "replay.jsonl"
    label_rows(rows, scorer, out=str(ref), max_batch_tokens=300, max_batch_rows=4)
    merge_shards(str(ref), 1)
    out = tmp_path / f"n{num_shards}" / "replay.jsonl"
    for shard in reversed(range(num_shards)):  # any order of array tasks
        label_rows(rows, scorer, out=str(out), shard=shard, num_shards=num_shards, max_batch_tokens=300,
                   max_batch_rows=4)
    merge_shards(str(out), num_shards, expected_rows=len(rows))
    assert out.read_bytes() == ref.read_bytes()
    lines = read_jsonl(out)
    assert [x["i"] for x in lines] == list(range(len(rows)))
    assert all(abs(sum(x["probs"]) - 1) < 1e-5 and len(x["probs"]) == len(r["options"])
               for x, r in zip(lines, rows, strict=True))


def test_replay_job_writes_and_merges_with_shift(finetunes, decider_data, tmp_path):
    from hobson.jobs import replay, teacher_merge

    out = tmp_path / "replay.jsonl"
    for k in range(2):
        assert replay.main(["--checkpoint", str(finetunes[1]), "--corpus", str(decider_data["train"]),
                            "--out", str(out), "--num-shards", "2", "--shards", "0-1", "--task-index", str(k),
                            "--max-batch-tokens", "400", "--threads", "1"]) == 0
    assert teacher_merge.main(["--out", str(out), "--num-shards", "2", "--shift-by",
                               str(decider_data["val"])]) == 0
    shifted = read_jsonl(tmp_path / "replay_train.jsonl")
    assert [x["i"] for x in shifted] == [i + 9 for i in range(40)]  # val.jsonl has 9 lines


def _delta_w(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.torso.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            out[name] = (m.lora_B["default"].weight @ m.lora_A["default"].weight) * m.scaling["default"]
    return out


def test_soup_is_the_mean_lora_update_and_the_mean_head(finetunes, tmp_path):
    soup = soup_checkpoints([str(p) for p in finetunes], tmp_path / "soup")
    parts = [load_decider(p) for p in finetunes]
    merged = load_decider(soup)
    assert merged.config.lora_r == 3 * parts[0].config.lora_r and merged.config.head_ensemble == 3
    assert merged.temperatures["global"] == 1.0 and merged.temperatures["per_kind"] == {}
    dws = [_delta_w(p.model) for p in parts]
    dw = _delta_w(merged.model)
    assert len(dw) == 6  # q_proj, v_proj, down_proj in 2 layers
    for name, w in dw.items():
        mean = sum(d[name] for d in dws) / 3
        assert mean.abs().max() > 1e-4  # the fine-tunes really moved
        assert torch.allclose(w, mean, atol=1e-6, rtol=0), name
    g = torch.Generator().manual_seed(0)
    answer, options = torch.randn(5, 32, generator=g), torch.randn(5, 4, 32, generator=g)
    with torch.no_grad():
        want = sum(p.model.head(answer, options) for p in parts) / 3
        got = merged.model.head(answer, options)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_soup_of_differing_configs_names_the_keys(finetunes, tmp_path):
    from hobson.decider.checkpoint import load_checkpoint, save_checkpoint

    # another training's checkpoint, written as hobson writes one (a hand-edited file would fail
    # its manifest instead)
    other = tmp_path / "other"
    ck = load_checkpoint(finetunes[1], trainer_state=False)
    cfg = {**ck.config, "lr": 0.5, "pointer_dim": 8, "seed": 7, "output_dir": "elsewhere"}  # seed/output_dir may differ
    save_checkpoint(other, config=cfg, adapter=ck.adapter, head=ck.head)
    with pytest.raises(ConfigError) as e:
        soup_checkpoints([str(finetunes[0]), str(other)], tmp_path / "soup")
    msg = str(e.value)
    assert "lr: " in msg and "pointer_dim: " in msg and "seed" not in msg.split("differ):")[1]
    assert not (tmp_path / "soup").exists()


def test_init_from_conflicts_name_every_key_before_loading(finetunes, config_factory, tmp_path):
    # The checkpoint has pointer_dim 16, lora_r 4, lora_alpha 8; the YAML below sets pointer_dim and
    # lora_r to their *defaults* (64, 8): present keys count as set.
    path = config_factory(tmp_path / "c.yaml", tmp_path / "out", init_from=str(finetunes[0]), pointer_dim=64,
                          lora_r=8, head_type="slot")
    data = yaml.safe_load(path.read_text())
    del data["lora_alpha"]  # absent: taken from the checkpoint, no conflict
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_train_config(path)
    msg = str(e.value)
    for key in ("pointer_dim: checkpoint 16, config 64", "lora_r: checkpoint 4, config 8",
                "head_type: checkpoint 'pointer', config 'slot'"):
        assert key in msg
    assert "lora_alpha" not in msg
    with pytest.raises(ConfigError, match="lora_targets: checkpoint"):
        load_train_config(config_factory(tmp_path / "d.yaml", tmp_path / "out", init_from=str(finetunes[0])),
                          ["lora_targets=[q_proj]"])


def test_init_from_freeze_torso_trains_the_head_alone(finetunes, config_factory, tmp_path):
    path = config_factory(tmp_path / "c.yaml", tmp_path / "out", init_from=str(finetunes[0]), freeze_torso=True,
                          epochs=1, max_length=200, kl_frozen_weight=0.0)
    data = yaml.safe_load(path.read_text())
    for k in ("lora_r", "lora_alpha", "pointer_dim"):  # taken from the checkpoint
        del data[k]
    path.write_text(yaml.safe_dump(data))
    cfg = load_train_config(path)
    assert (cfg.lora_r, cfg.pointer_dim, cfg.max_length) == (4, 16, 200)
    assert recipe_main(cfg) == 0
    init, final = load_checkpoint(finetunes[0]), load_checkpoint(tmp_path / "out" / "final")
    assert init.adapter.keys() == final.adapter.keys()
    assert all(torch.equal(init.adapter[k], final.adapter[k]) for k in init.adapter)
    assert any(not torch.equal(init.head[k], final.head[k]) for k in init.head)
    assert final.temperatures == {"global": 1.0, "per_kind": {}}


@pytest.fixture(scope="module")
def other_tokenizer_reference(decider_data, tmp_path_factory) -> Path:
    """A checkpoint on another torso with another tokenizer (hidden 64, 768-token BPE)."""
    import dataclasses

    from transformers import AutoTokenizer

    from hobson.decider.checkpoint import save_checkpoint
    from hobson.decider.config import TrainConfig
    from hobson.decider.model import build_decider
    from hobson.tinymodel import build_tiny_causal_lm, build_tokenizer

    root = tmp_path_factory.mktemp("reference")
    rows = read_jsonl(decider_data["train"])
    tok = build_tokenizer([r["state"] + " " + r["instructions"] for r in rows] * 3 + ["Answer: A B C"])
    build_tiny_causal_lm(tok, seed=1).save_pretrained(root / "torso")
    tok.save_pretrained(root / "torso")
    cfg = TrainConfig(base_model=str(root / "torso"), train_files=[str(decider_data["train"])],
                      output_dir=str(root), pointer_dim=8, lora_r=2, lora_alpha=4, max_length=256, seed=5)
    model = build_decider(cfg, AutoTokenizer.from_pretrained(root / "torso"))
    save_checkpoint(root / "ckpt", config=dataclasses.asdict(cfg), adapter=model.adapter_state(),
                    head=model.head_state(), temperatures={"global": 0.5, "per_kind": {"score": 2.0}})
    return root / "ckpt"


def test_kl_frozen_reference_with_another_tokenizer_is_precomputed_once(other_tokenizer_reference, config_factory,
                                                                         decider_data, tmp_path, capsys):
    path = config_factory(tmp_path / "c.yaml", tmp_path / "out", kl_frozen_reference=str(other_tokenizer_reference),
                          precompute_frozen_kl=True, epochs=1, stop_after_steps=2)
    recipe = DeciderTrainRecipe(load_train_config(path))
    try:
        recipe.setup()
        assert recipe.model.lm_head_weight is None and len(recipe.frozen_targets) == 40
        ref = load_decider(other_tokenizer_reference)
        rows = recipe.rows[:6]
        assert ref.tokenizer(rows[0]["state"])["input_ids"] != recipe.tokenizer(rows[0]["state"])["input_ids"]
        from hobson.decider.predict import predict_logits, probabilities

        # Its own rendering and tokenizer, its calibrated temperatures, canonical option slots.
        want = probabilities(predict_logits(ref, rows), rows, ref.temperatures)
        for i in range(6):
            assert recipe.frozen_targets[i] == pytest.approx(want[i], abs=1e-6)
            assert len(want[i]) == len(rows[i]["options"])
        assert recipe.train() == 0
    finally:
        recipe.cleanup()
    logs = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert any(x.get("kl_frozen", 0) > 0 for x in logs)
    with pytest.raises(ConfigError, match="precompute_frozen_kl: true"):
        load_train_config(config_factory(tmp_path / "d.yaml", tmp_path / "o", kl_frozen_reference="x"))


def test_precomputed_frozen_torso_targets_match_the_readout(config_factory, tmp_path):
    path = config_factory(tmp_path / "c.yaml", tmp_path / "out", precompute_frozen_kl=True, epochs=1)
    recipe = DeciderTrainRecipe(load_train_config(path))
    try:
        recipe.setup()
        from hobson.decider.collate import Collator

        rows = [(i, recipe.rows[i]) for i in range(4)]
        batch = Collator(recipe.tokenizer, max_length=128, force_bos=False, seed=0, shuffle=False).collate(rows)
        want = torch.softmax(recipe.model.frozen_logits(batch).masked_fill(~batch.option_mask, float("-inf")), -1)
        for b, (i, row) in enumerate(rows):
            n = len(row["options"])
            assert recipe.frozen_targets[i] == pytest.approx(want[b, :n].tolist(), abs=1e-5)
        out = recipe.model(batch)
        assert out["frozen_logits"] is None  # no second forward per micro-batch
    finally:
        recipe.cleanup()


def test_host_embeddings_refused_under_torchrun(config_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out", host_embeddings=True))
    with pytest.raises(ConfigError, match="host_embeddings: true .* one process only, but WORLD_SIZE=2"):
        DeciderTrainRecipe(cfg)


def _paired(rows: list[dict], path: Path, flip: bool) -> Path:
    out = []
    for k, row in enumerate(rows[:10]):
        a = dict(row, pair=k)
        b = dict(row, pair=k, instructions=("Now pick the opposite of: " if flip else "In other words: ")
                 + row["instructions"], label=(row["label"] + 1) % len(row["options"]) if flip else row["label"])
        out += [a, b]
    from hobson.io import dumps_row

    path.write_text("".join(dumps_row(r) + "\n" for r in out))
    return path


def test_release_route_and_evaluation_outputs(finetunes, decider_data, tmp_path, capsys):
    from hobson.jobs import ask, compare, evaluate, release

    rows = read_jsonl(decider_data["train"])
    cons = _paired(rows, tmp_path / "consistency.jsonl", flip=False)
    flip = _paired(rows, tmp_path / "flip.jsonl", flip=True)
    evals = [str(decider_data["train"]), str(decider_data["val"])]  # 49 rows: 24 test, 25 calibration
    rel = tmp_path / "release"
    assert release.main([*map(str, finetunes), "--out", str(rel), "--eval-files", *evals, "--catchall",
                         str(decider_data["val"]), "--consistency", str(cons), "--flip", str(flip),
                         "--min-kind-rows", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| all | 24 |" in out and "## Per task" in out and "agreement" in out
    report = json.loads((rel / "eval" / "report.json").read_text())
    temps = json.loads((rel / "calibrated" / "temperatures.json").read_text())
    assert temps["calibration"]["rows"] == 25 and set(temps["per_kind"]) == {"choice", "noul", "score"}
    assert report["temperatures"]["global"] == temps["global"]
    assert set(report["per_kind"]) == {"choice", "noul", "score"} and set(report["per_task"]) == {"family1", "family3"}
    assert report["consistency"]["pairs"] == 10 and report["flip"]["pairs"] == 10
    assert report["catchall"]["rows"] == 9
    preds = read_jsonl(rel / "eval" / "predictions.jsonl")
    assert [p["index"] for p in preds] == list(range(1, 49, 2))
    assert (rel / "eval" / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((rel / "soup" / "temperatures.json").read_text())["global"] == 1.0
    # The same evaluation again (another process would do the same): identical report bytes.
    assert evaluate.main(["--checkpoint", str(rel / "calibrated"), "--out", str(tmp_path / "again"),
                          "--eval-files", *evals, "--catchall", str(decider_data["val"]), "--consistency",
                          str(cons), "--flip", str(flip), "--threads", "1"]) == 0
    for name in ("report.json", "predictions.jsonl", "report.md", "reliability.png"):
        again = (tmp_path / "again" / name).read_bytes()
        assert again == (rel / "eval" / name).read_bytes(), name
    assert report["checkpoint"] == "release/calibrated"
    assert report["eval_files"][0] == f"{decider_data['root'].name}/train.jsonl"  # no absolute paths
    # Compare the soup with one of its parts, and ask the soup a question.
    assert evaluate.main(["--checkpoint", str(finetunes[0]), "--out", str(tmp_path / "s0"), "--eval-files", *evals,
                          "--no-plot", "--threads", "1"]) == 0
    capsys.readouterr()
    assert compare.main([str(rel / "eval"), str(tmp_path / "s0"), "--out", str(tmp_path / "cmp.json")]) == 0
    table = capsys.readouterr().out
    assert "McNemar p" in table and "| all | 24 |" in table
    assert ask.main([str(rel / "calibrated"), "--state", "the red box", "--choice",
                     "Which one?=apple,river,stone"]) == 0
    answer = capsys.readouterr().out.splitlines()
    assert answer[0] == "Which one?" and len(answer) == 4 and sum("*" in a for a in answer) == 1
    probs = [float(a.split()[-2]) for a in answer[1:]]
    assert abs(sum(probs) - 1) < 2e-4
