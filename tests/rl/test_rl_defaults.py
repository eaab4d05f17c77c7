"""A run with no convention flags records VIME's choices (run.json) and acts on them: completions per
prompt, precision, long prompts left out before the cursor counts rows, a refused resume of a run
recorded under other conventions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hobson.jobs.rl import main
from hobson.rl.config import CONVENTIONS_VERSION, RLConfig, resolve_defaults

FAST = ["--max-new-tokens", "3", "--updates", "1", "--device", "cpu", "--trainer", "torch"]


@pytest.mark.parametrize(("alg", "completions"), [("ppo", 1), ("grpo", 4), ("dppo", 1), ("flow-dppo", 1)])
def test_defaults_are_vimes_and_recorded(tmp_path: Path, alg: str, completions: int) -> None:
    out = tmp_path / alg
    assert main(["--algorithm", alg, "--output", str(out), *FAST]) == 0
    rl = json.loads((out / "run.json").read_text())["rl"]
    s, c = rl["settings"], rl["conventions"]
    assert (s["completions_per_prompt"], s["precision"]) == (completions, "fp32")
    assert (s["loss_aggregation"], s["gae_masked"], s["long_prompts"], s["grad_clip"]) == (
        "sample-mean", "span", "drop", 1.0)
    assert c["version"] == CONVENTIONS_VERSION and c["completions_per_prompt"] == completions
    assert c["latent_seed"].startswith("blake2b") and c["kl_metric"] == "k1"
    rollouts = [json.loads(x) for x in (out / "rollouts" / "update-000001.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 * completions  # 4 prompts per update
    assert sorted({r["completion_index"] for r in rollouts}) == list(range(completions))
    steps = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["steps"]
    assert len(steps) == (2 if alg == "flow-dppo" else 1) and all("grad_norm" in st for st in steps)


def test_huginn_defaults_to_fp16_on_cuda_only() -> None:
    assert resolve_defaults(RLConfig(device="cuda:0")).precision == "fp16"
    assert resolve_defaults(RLConfig(device="cpu")).precision == "fp32"
    assert resolve_defaults(RLConfig(model="tiny:nanbeige", device="cuda:0")).precision == "fp32"
    assert resolve_defaults(RLConfig(device="cuda:0", precision="fp32")).precision == "fp32"


def test_long_prompts_are_left_out_before_the_cursor(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "x" * (200 if i in (1, 4) else 10) + f" {i}", "label": "1"} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert main(["--output", str(out), "--data", str(data), "--algorithm", "ppo", *FAST]) == 0
    assert "left out 2 of 6 prompts longer than 128 tokens" in capsys.readouterr().out
    rl = json.loads((out / "run.json").read_text())["rl"]
    event = next(e for e in rl["sessions"][0]["events"] if e["event"] == "dropped_long_prompts")
    assert (event["count"], event["first_lines"]) == (2, [2, 5])
    lines = [json.loads(x)["data_line"] for x in (out / "rollouts" / "update-000001.jsonl").read_text().splitlines()]
    assert lines == [1, 3, 4, 6]  # the cursor counts the kept rows
    kept = tmp_path / "trunc"
    assert main(["--output", str(kept), "--data", str(data), "--algorithm", "ppo", "--long-prompts", "truncate",
                 *FAST]) == 0
    lines = [json.loads(x)["data_line"] for x in (kept / "rollouts" / "update-000001.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4]
    assert main(["--output", str(tmp_path / "none"), "--data", str(data), "--max-prompt-tokens", "5", *FAST]) == 1
    err = capsys.readouterr().err
    assert f"{data}:1: every one of the 6 prompts is longer than max_prompt_tokens (5 tokens)" in err
    assert "--long-prompts truncate" in err


def test_resume_of_a_run_under_other_conventions_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    args = ["--output", str(out), "--algorithm", "ppo", *FAST[:-6], "--updates", "2", *FAST[-4:]]
    assert main([*args, "--stop-after", "1"]) == 0
    meta = json.loads((out / "run.json").read_text())
    meta["rl"]["conventions"]["value_loss"] = "half squared"
    (out / "run.json").write_text(json.dumps(meta))
    assert main([*args, "--resume"]) == 1
    assert "value_loss: run has 'half squared'" in capsys.readouterr().err
    del meta["rl"]["conventions"]  # a run of hobson before conventions were recorded
    (out / "run.json").write_text(json.dumps(meta))
    assert main([*args, "--resume"]) == 1
    assert "recorded before conventions were recorded (version 1" in capsys.readouterr().err


def test_missing_data_and_bad_eval_paths_are_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hobson.jobs.rl_eval import main as rl_eval

    missing = tmp_path / "missing.jsonl"
    assert main(["--output", str(tmp_path / "run"), "--data", str(missing), *FAST]) == 1
    assert f"{missing}: no such file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert rl_eval([str(tmp_path / "nothing"), "--data", str(missing)]) == 1
    assert "neither a publication (no manifest.json) nor an RL run" in capsys.readouterr().err


def _unusable_cuda() -> str:
    """A CUDA device this machine cannot give: any on a CPU torch (CI), one past the last on a GPU host."""
    import torch

    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def test_a_cuda_device_this_torch_cannot_give_is_one_clear_error(tmp_path: Path) -> None:
    """`sbatch sbatch/grpo.sh` defaults to DEVICE=cuda: on a CPU-only torch (or past the last GPU)
    the trainer and the rollout server each print one line naming the setting and the fix."""
    import subprocess
    import sys

    device = _unusable_cuda()
    for argv in (["-m", "jobs.rl", "--output", str(tmp_path / "run"), *FAST, "--device", device],
                 ["-m", "jobs.rollout_server", "--address-file", str(tmp_path / "a.json"), "--device", device]):
        p = subprocess.run([sys.executable, *argv], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        (line,) = [x for x in p.stderr.splitlines() if "error:" in x]
        assert f"device {device} (--device; " in line and "sbatch scripts" in line and "cpu" in line, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "a.json").exists()


def test_an_output_that_cannot_be_a_directory_is_one_clear_error(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """(Tests run as root, whom permissions do not stop: a path under a regular file cannot be made.)"""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["--output", str(afile / "run"), *FAST]) == 1
    err = capsys.readouterr().err
    assert f"--output {afile / 'run'}: {afile} is a file, not a directory" in err and "internal error" not in err


def test_a_model_directory_of_another_architecture_is_one_clear_error(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Huginn's weights under a Nanbeige config.json, and a model directory whose weights file is empty: one
    `rl: error:` line each, naming the directory and what to pass, before any output is written."""
    import shutil

    from hobson.models import get_provider, tiny_config

    h = tiny_config("huginn_raven")
    get_provider(h).export(get_provider(h).build_actor(h, seed=0), tmp_path / "huginn")
    n = tiny_config("nanbeige")
    get_provider(n).export(get_provider(n).build_actor(n, seed=0), tmp_path / "nanbeige")
    swapped = tmp_path / "swapped"
    shutil.copytree(tmp_path / "huginn", swapped)
    shutil.copy(tmp_path / "nanbeige" / "config.json", swapped / "config.json")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text('{"model_type": "bert", "hidden_size": 8}')
    (bert / "model.safetensors").write_bytes(b"")
    for model, words in ((swapped, ("names do not match", "another architecture", "belong together")),
                         (bert, ("model.safetensors", "not a readable safetensors file", "copy it again"))):
        out = tmp_path / f"out-{model.name}"
        assert main(["--model", str(model), "--output", str(out), "--updates", "1", "--device", "cpu"]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rl: error: ") and str(model) in err[0], err
        assert all(w in err[0] for w in words), err
        assert not (out / "checkpoints").exists()


def test_a_missing_deepspeed_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`--trainer deepspeed` (the default) in a Python without deepspeed (a GPU image without the RL
    extra): one line naming the setting and both ways out, before anything is written."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    out = tmp_path / "run"
    assert main(["--output", str(out), "--updates", "1", "--device", "cpu"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rl: error: --trainer deepspeed"), err
    assert "pip install -e" in err[0] and "--trainer torch" in err[0]
    assert not out.exists() or not any(out.iterdir())
