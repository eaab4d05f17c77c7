"""Config errors, shipped configs, the model's heads and frozen readout, checkpoint files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from hobson.decider.checkpoint import load_checkpoint, save_checkpoint
from hobson.decider.collate import Collator
from hobson.decider.config import TrainConfig, config_to_dict, load_train_config, resume_conflicts
from hobson.decider.model import build_decider
from hobson.decider.train import DeciderTrainRecipe, recipe_main
from hobson.errors import ConfigError, DataError
from hobson.io import read_jsonl
from hobson.labels.prompt import letter_token_ids

REPO = Path(__file__).resolve().parents[2]


def test_unknown_config_key_names_key_and_file(tmp_path, config_factory):
    path = config_factory(tmp_path / "c.yaml", tmp_path / "out")
    data = yaml.safe_load(path.read_text())
    data["learning_rate"] = 0.1
    data["lora_rank"] = 4
    path.write_text(yaml.safe_dump(data, sort_keys=True))
    with pytest.raises(ConfigError) as e:
        load_train_config(path)
    msg = str(e.value)
    assert f"{path}:" in msg and "unknown key 'learning_rate'" in msg and "unknown key 'lora_rank'" in msg
    good = config_factory(tmp_path / "g.yaml", tmp_path / "out")
    with pytest.raises(ConfigError, match="unknown key 'lrr'"):
        load_train_config(good, ["lrr=0.1"])
    assert load_train_config(good, ["lr=0.5", "lora_targets=[q_proj]"]).lr == 0.5
    with pytest.raises(ConfigError, match="kl_direction 'sideways' is not one of forward, reverse"):
        load_train_config(good, ["kl_direction=sideways"])


@pytest.mark.parametrize("name", ["train.yaml", "train-parent.yaml"])
def test_shipped_configs_load(name):
    cfg = load_train_config(REPO / "configs" / name)
    assert isinstance(cfg, TrainConfig)


def _cfg(config_factory, tmp_path, **over) -> TrainConfig:
    return load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out", **over))


def test_frozen_readout_is_the_base_lm_with_adapter_disabled(decider_data, config_factory, tmp_path):
    cfg = _cfg(config_factory, tmp_path)
    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    model = build_decider(cfg, tok).eval()
    rows = read_jsonl(decider_data["train"])[:4]
    batch = Collator(tok, max_length=128, force_bos=False, seed=0).collate(list(enumerate(rows)))
    lm = AutoModelForCausalLM.from_pretrained(decider_data["torso"]).eval()
    letters = letter_token_ids(tok)
    with torch.no_grad():
        full = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        for lora in (p for n, p in model.named_parameters() if "lora_B" in n):
            lora.add_(0.5)  # a trained adapter changes the student but not the frozen readout
        out = model(batch)
        student = model.torso(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    N = batch.option_pos.shape[1]
    ref = full[torch.arange(4), batch.answer_pos][:, letters[:N]]
    assert torch.allclose(out["frozen_logits"], ref, atol=1e-5)
    with torch.no_grad(), model.torso.disable_adapter():
        base = model.torso(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    assert not torch.allclose(student, base)
    # the decider's own switch (no status report, no requires_grad reset) is peft's, bit for bit,
    # and leaves the adapter on and trainable after the block
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad(), model.adapters_off():
        off = model.torso(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    assert torch.equal(off, base)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable and trainable
    with torch.no_grad():
        again = model.torso(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    assert torch.equal(again, student)


def test_pointer_head_takes_any_option_count_slot_head_refuses(decider_data, config_factory, tmp_path):
    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    row = {"kind": "choice", "state": "s", "instructions": "pick", "label": 29, "task": "t", "weight": 1.0,
           "options": [[f"o{j}", ""] for j in range(30)], "instruction_variants": []}
    batch = Collator(tok, max_length=1024, force_bos=False, seed=0).collate([(0, row)])
    assert "27. o" in tok.decode(batch.token_ids[0])
    model = build_decider(_cfg(config_factory, tmp_path, kl_frozen_weight=0.0), tok)
    assert model(batch)["logits"].shape == (1, 30)
    slot = build_decider(_cfg(config_factory, tmp_path, kl_frozen_weight=0.0, head_type="slot", num_slots=8), tok)
    with pytest.raises(DataError, match="30 options but the slot head has num_slots=8"):
        slot(batch)


def test_checkpoint_directory_is_self_describing(tmp_path):
    path = tmp_path / "ck"
    digests = save_checkpoint(path, config={"lr": 0.1}, adapter={"a": torch.ones(2)}, head={"h": torch.zeros(3)},
                              trainer_state={"step": 4})
    assert sorted(digests) == ["adapter.safetensors", "config.json", "head.safetensors", "temperatures.json",
                               "trainer_state.pt"]
    save_checkpoint(path, config={"lr": 0.2}, adapter={"a": torch.ones(2)}, head={"h": torch.zeros(3)})
    ck = load_checkpoint(path)
    assert ck.config == {"lr": 0.2} and ck.trainer_state is None
    assert json.loads((path / "temperatures.json").read_text()) == {"global": 1.0, "per_kind": {}}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp directories left behind


def test_resume_refuses_a_changed_config(config_factory, tmp_path):
    out = tmp_path / "out"
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", out, stop_after_steps=1, epochs=1))
    assert recipe_main(cfg) == 0
    changed = load_train_config(config_factory(tmp_path / "d.yaml", out, epochs=1, lr=0.5, seed=4))
    recipe = DeciderTrainRecipe(changed)
    try:
        with pytest.raises(ConfigError, match=r"(?s)the config differs in.*lr: checkpoint 0.01, now 0.5.*seed"):
            recipe.setup()
    finally:
        recipe.cleanup()


def test_gradient_checkpointing_gives_the_same_gradients(decider_data, config_factory, tmp_path):
    tok = AutoTokenizer.from_pretrained(decider_data["torso"])
    rows = read_jsonl(decider_data["train"])[:5]
    batch = Collator(tok, max_length=128, force_bos=False, seed=0).collate(list(enumerate(rows)))
    grads = []
    for gc in (False, True):
        model = build_decider(_cfg(config_factory, tmp_path, gradient_checkpointing=gc), tok).train()
        for p in (p for n, p in model.named_parameters() if "lora_B" in n):
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(0))
        out = model(batch)
        (out["logits"].logsumexp(-1).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.trainable_parameters()]))
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_teacher_lines_are_checked_with_file_and_line(decider_data, tmp_path):
    from hobson.decider.train import read_teacher, read_training_rows

    rows = read_training_rows([str(decider_data["train"])])
    first = decider_data["teacher"].read_text().splitlines()[0]
    dup = tmp_path / "dup.jsonl"
    dup.write_text(first + "\n")
    with pytest.raises(DataError, match=rf"{dup}:1: i=1 already has teacher probabilities from .*teacher.jsonl:1"):
        read_teacher([str(decider_data["teacher"]), str(dup)], rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"i": 1, "probs": [0.5, 0.5]}\n')
    with pytest.raises(DataError, match=rf"{bad}:1: 2 probs for training row 1 with 4 options"):
        read_teacher([str(bad)], rows)


def test_cli_help_and_config_error_exit_code(tmp_path, subprocess_env):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "jobs.train", "--help"], cwd=REPO, env=subprocess_env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "KEY=VALUE" in out.stdout and "SIGUSR2" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("base_model: x\ntrain_files: [a]\noutput_dir: o\nlearning_rate: 1\n")
    out = subprocess.run([sys.executable, "-m", "jobs.train", "--config", str(bad)], cwd=REPO, env=subprocess_env,
                         capture_output=True, text=True)
    assert out.returncode == 1 and f"{bad}:4: unknown key 'learning_rate'" in out.stderr


def test_attention_runs_without_cudnn_sdpa_forward_and_recompute(config_factory, tmp_path, monkeypatch):
    """cuDNN's SDPA builds a graph per batch shape (1.55 s of a 2.56 s step, profiled on an H200):
    the torso's attention, and the recompute of a checkpointed backward, run with it switched off."""
    seen: list[tuple[bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.is_grad_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", tmp_path / "out", stop_after_steps=1,
                                           gradient_checkpointing=True))
    assert recipe_main(cfg) == 0
    assert seen and not any(cudnn for cudnn, _ in seen)
    assert any(grad for _, grad in seen) and any(not grad for _, grad in seen)  # trained and frozen forwards
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process-wide flag is put back


def test_length_group_by_is_validated_and_a_resume_keeps_it(config_factory, tmp_path):
    """The grouping key shapes the step plan: a resume under another key is refused, naming it."""
    with pytest.raises(ConfigError, match="length_group_by 'words' is not one of tokens, chars"):
        load_train_config(config_factory(tmp_path / "bad.yaml", tmp_path / "bad", length_group_by="words"))
    out = tmp_path / "out"
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", out, stop_after_steps=1, length_group_by="chars"))
    assert recipe_main(cfg) == 0
    recipe = DeciderTrainRecipe(load_train_config(config_factory(tmp_path / "d.yaml", out)))
    try:
        with pytest.raises(ConfigError, match="length_group_by: checkpoint 'chars', now 'tokens'"):
            recipe.setup()
    finally:
        recipe.cleanup()


def test_missing_model_data_and_unusable_output_are_one_clear_error(tmp_path, decider_data, subprocess_env):
    """Each bad path in a training config: exit 1, one `train: error:` line naming the key, no traceback."""
    import subprocess
    import sys

    from tests.decider.conftest import base_config

    good = base_config(decider_data, tmp_path / "out")
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = {"base_model": ({"base_model": str(tmp_path / "nope")}, "base_model: "),
             "train_files": ({"train_files": [str(tmp_path / "missing.jsonl")]}, "train_files: "),
             "output_dir": ({"output_dir": str(afile / "out")}, f"output_dir: {afile / 'out'}: {afile} is a file")}
    for name, (change, expect) in cases.items():
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({**good, **change}))
        p = subprocess.run([sys.executable, "-m", "jobs.train", "--config", str(cfg)], cwd=REPO, env=subprocess_env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and "Traceback" not in p.stderr, (name, p.stderr)
        (line,) = [x for x in p.stderr.splitlines() if x.startswith("train: error:")]
        assert expect in line, (name, line)


def test_max_steps_ends_the_run_with_its_final_checkpoint(config_factory, tmp_path, capsys):
    """A few steps on the full data (smoke runs, the Slurm tests): the schedule spans them, final/
    is written, and a resume with another max_steps is refused (it changes what is computed)."""
    out = tmp_path / "out"
    cfg = load_train_config(config_factory(tmp_path / "c.yaml", out, max_steps=2, epochs=1))
    recipe = DeciderTrainRecipe(cfg)
    try:
        recipe.setup()
        assert recipe.sampler.total_steps() > 2 and recipe.total_steps == 2
        assert recipe.train() == 0
    finally:
        recipe.cleanup()
    steps = [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()
             if line.startswith("{") and '"loss"' in line]
    assert steps == [1, 2]
    assert (out / "final" / "adapter.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    assert resume_conflicts(config_to_dict(cfg), load_train_config(
        config_factory(tmp_path / "d.yaml", out, max_steps=3, epochs=1))) == ["max_steps: checkpoint 2, now 3"]
