"""DDP equals one process, and checkpoint/resume is bit-exact (CPU, gloo).

One config (tests/decider/conftest.py): 40 rows, micro-batches of 3, 3 per optimizer step, 2
epochs = 10 steps crossing an epoch boundary after step 5; LoRA, pointer head, teacher KL,
frozen-torso KL, KL-only rows (weight 0) and weights 0.5/1/2. Multi-rank runs are forked ranks
(``run_local_ranks``); the one-process reference runs inside pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hobson import faults
from hobson.decider.config import load_train_config
from hobson.decider.train import PREEMPT_EXIT_CODE, recipe_main, run_local_ranks

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
RANKS_TIMEOUT_S = 600  # a run takes seconds; 8 ranks on 2 busy cores well under a minute


@pytest.fixture(scope="module")
def runs(config_factory, tmp_path_factory):
    """``run(name, world, **overrides) -> run dir`` (cached by name); trace in ``<dir>/trace``."""
    root = tmp_path_factory.mktemp("runs")
    done: dict[str, Path] = {}

    def run(name: str, world: int, output: str | None = None, **over) -> Path:
        if name not in done:
            d = root / name
            d.mkdir()
            out = root / (output or name) / "out"
            cfg = config_factory(d / "train.yaml", out, trace_dir=str(d / "trace"), **over)
            if world == 1 and name == "w1":
                assert recipe_main(load_train_config(cfg)) == 0
            else:
                # a hang fails this run with every rank's stacks, never the whole suite
                run_local_ranks(str(cfg), [], world, timeout_s=RANKS_TIMEOUT_S)
            done[name] = root / (output or name)
        return done[name]
    return run


def _tokens(run_dir: Path, step: int) -> dict[str, list[int]]:
    merged: dict[str, list[int]] = {}
    for f in sorted((run_dir / "trace").glob(f"tokens_step{step:04d}_rank*.json")):
        part = json.loads(f.read_text())
        assert not set(part) & set(merged), f"a row was rendered by two ranks at step {step}"
        merged.update(part)
    return merged


def _final(run_dir: Path) -> tuple[dict, dict]:
    final = run_dir / "out" / "final"
    return load_file(str(final / "adapter.safetensors")), load_file(str(final / "head.safetensors"))


def _assert_resumed_after(resumed: Path, step: int, full: Path) -> None:
    """The resumed run trained only steps ``step+1..``, each on the uninterrupted run's exact gradient."""
    traced = sorted(int(f.name[len("grads_step"):-3]) for f in (resumed / "trace").glob("grads_step*.pt"))
    assert traced == list(range(step + 1, STEPS + 1))
    for s in traced:
        assert torch.equal(torch.load(resumed / "trace" / f"grads_step{s:04d}.pt"),
                           torch.load(full / "trace" / f"grads_step{s:04d}.pt")), s


def _assert_bit_identical(a: Path, b: Path) -> None:
    (ad_a, hd_a), (ad_b, hd_b) = _final(a), _final(b)
    assert ad_a.keys() == ad_b.keys() and hd_a.keys() == hd_b.keys() and ad_a
    for k in ad_a:
        assert torch.equal(ad_a[k], ad_b[k]), k
    for k in hd_a:
        assert torch.equal(hd_a[k], hd_b[k]), k


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ddp_gradients_and_rendering_equal_one_process(runs, world):
    one = runs("w1", 1)
    many = runs(f"w{world}", world)
    idle_seen = False
    worst = 0.0
    for step in range(1, STEPS + 1):
        ref_tokens = _tokens(one, step)
        got_tokens = _tokens(many, step)
        assert got_tokens == ref_tokens, f"step {step}: rows rendered differently"
        per_rank = [json.loads(f.read_text()) for f in (many / "trace").glob(f"tokens_step{step:04d}_rank*.json")]
        assert len(per_rank) == world
        idle_seen |= any(not p for p in per_rank)
        g1 = torch.load(one / "trace" / f"grads_step{step:04d}.pt")
        gn = torch.load(many / "trace" / f"grads_step{step:04d}.pt")
        rel = float((g1 - gn).norm() / g1.norm())
        assert rel < 1e-5, f"world {world} step {step}: relative gradient difference {rel:.2e}"
        worst = max(worst, rel)
    print(f"world {world}: worst per-step relative gradient difference {worst:.2e}")
    # 3 micro-batches per step (2 in an epoch's last step): at 3 and 4 ranks some rank sits a
    # step out and must still join the all-reduce.
    assert idle_seen == (world >= 3)
    assert not list((many / "trace").glob(f"grads_step{STEPS + 1:04d}.pt"))


def test_stop_and_resume_one_rank_bit_identical(runs):
    full = runs("w1", 1)
    stopped = runs("w1_stop", 1, stop_after_steps=3)
    ckpts = sorted(p.name for p in (stopped / "out" / "checkpoints").iterdir())
    assert ckpts == ["step_00000003"] and not (stopped / "out" / "final").exists()
    resumed = runs("w1_resume", 1, output="w1_stop")  # a fresh process, same output_dir
    _assert_resumed_after(resumed.parent / "w1_resume", 3, full)
    _assert_bit_identical(full, resumed)


def test_stop_and_resume_two_ranks_bit_identical(runs):
    full = runs("w2", 2)
    stopped = runs("w2_stop", 2, stop_after_steps=3)
    assert (stopped / "out" / "checkpoints" / "step_00000003" / "trainer_state.pt").is_file()
    state = torch.load(stopped / "out" / "checkpoints" / "step_00000003" / "trainer_state.pt", weights_only=False)
    assert state["world_size"] == 2 and len(state["rng"]) == 2 and state["sampler"]["step"] == 3
    resumed = runs("w2_resume", 2, output="w2_stop")
    _assert_resumed_after(resumed.parent / "w2_resume", 3, full)
    _assert_bit_identical(full, resumed)


def test_usr2_checkpoints_then_resume_matches(runs, config_factory, tmp_path, subprocess_env):
    full = runs("w1", 1)
    out = tmp_path / "usr2" / "out"
    cfg = config_factory(tmp_path / "usr2.yaml", out)
    holds = tmp_path / "holds"
    env = {**subprocess_env, faults.ENV_POINTS: "train-step-3", faults.ENV_DIR: str(holds)}
    proc = subprocess.Popen([sys.executable, "-m", "jobs.train", "--config", str(cfg)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the signal lands while the trainer holds before step 3, whatever the machine's speed
    faults.wait_held(holds, "train-step-3", 300, alive=lambda: proc.poll() is None)
    os.kill(proc.pid, signal.SIGUSR2)
    stdout, err = proc.communicate(timeout=300)
    lines = stdout.splitlines(keepends=True)
    assert proc.returncode == PREEMPT_EXIT_CODE, f"exit {proc.returncode}\n{''.join(lines)}\n{err}"
    records = [json.loads(x) for x in lines if x.startswith("{")]
    at = next(r["preempted_at_step"] for r in records if "preempted_at_step" in r)
    assert at == 3
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{at:08d}"]
    assert not (out / "final").exists()
    resumed = runs("usr2_resume", 1, output=str(tmp_path / "usr2"))
    _assert_resumed_after(full.parent / "usr2_resume", at, full)
    _assert_bit_identical(full, resumed)


def _tb_scalars(tb: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


TB_TAGS = ("loss", "ce", "kl_teacher", "kl_frozen", "acc", "grad_norm", "lr")


def test_tensorboard_holds_each_logged_scalar_once_across_a_resume(runs, config_factory, tmp_path,
                                                                   subprocess_env):
    """<output_dir>/tb: every logged number of every step, equal to the log line's (one process,
    its stdout read whole); a stopped and resumed two-rank run has each step once, with the
    uninterrupted two-rank run's values (resume is exact), written by rank 0 only."""
    cfg = config_factory(tmp_path / "train.yaml", tmp_path / "out")
    proc = subprocess.run([sys.executable, "-m", "jobs.train", "--config", str(cfg)], cwd=REPO, env=subprocess_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"acc"')]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    one = _tb_scalars(tmp_path / "out" / "tb")
    assert "tokens_per_s" in one
    for tag in TB_TAGS:
        assert [s for s, _ in one[tag]] == list(range(1, STEPS + 1)), tag
        assert [v for _, v in one[tag]] == pytest.approx([r[tag] for r in lines], rel=1e-6, abs=1e-12), tag
    full = _tb_scalars(runs("w2", 2) / "out" / "tb")
    runs("tb_stop", 2, stop_after_steps=3)
    resumed = runs("tb_resume", 2, output="tb_stop")
    again = _tb_scalars(resumed / "out" / "tb")
    for tag in (*TB_TAGS, "tokens_per_s"):
        assert [s for s, _ in again[tag]] == list(range(1, STEPS + 1)), (tag, again[tag])
        assert [s for s, _ in full[tag]] == list(range(1, STEPS + 1)), (tag, full[tag])
    for tag in TB_TAGS:
        assert again[tag] == full[tag], tag


def test_hung_local_ranks_fail_with_their_stacks(config_factory, tmp_path):
    """A rank held forever (a fault point nobody releases) ends in a TimeoutError that holds each
    rank's stacks, and leaves no rank process behind."""
    cfg = config_factory(tmp_path / "train.yaml", tmp_path / "out")
    holds = tmp_path / "holds"
    env = {faults.ENV_POINTS: "train-step-2", faults.ENV_DIR: str(holds)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with pytest.raises(TimeoutError) as err:
            # it times out once both ranks hold at step 2, whatever the machine's speed
            run_local_ranks(str(cfg), [], 2, timeout_s=RANKS_TIMEOUT_S,
                            give_up=lambda: len(list(holds.glob("train-step-2.held.*"))) == 2)
    text = str(err.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text and "in hold" in text, text
    ranks = [int(f.read_text()) for f in holds.glob("train-step-2.held.*")]
    assert len(ranks) == 2 and not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], ranks


# --- verified checkpoints ------------------------------------------------------------------------

CHECKPOINT_FILES = ["adapter.safetensors", "head.safetensors", "trainer_state.pt", "config.json",
                    "temperatures.json", "manifest.json"]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _stopped_copy(runs, tmp_path: Path, world: int) -> Path:
    """A copy of a run stopped after step 3 that checkpointed every step (steps 1, 2, 3)."""
    import shutil

    stopped = runs(f"w{world}_stop_every", world, stop_after_steps=3, checkpoint_every=1)
    shutil.copytree(stopped / "out", tmp_path / "case" / "out")
    return tmp_path / "case"


@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_resume_ends_bit_identical(runs, config_factory, tmp_path,
                                                                                      capsys, name):
    """One flipped byte in any file of the newest checkpoint: the resume names the file, keeps the
    checkpoint as step_00000003.corrupt, resumes from step 2, and ends with the uninterrupted bits."""
    full = runs("w1", 1)
    case = _stopped_copy(runs, tmp_path, 1)
    newest = case / "out" / "checkpoints" / "step_00000003"
    _flip_a_byte(newest / name)
    cfg = config_factory(case / "resume.yaml", case / "out", trace_dir=str(case / "trace"))
    capsys.readouterr()
    assert recipe_main(load_train_config(cfg)) == 0
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    (event,) = [r for r in records if "corrupt_checkpoint" in r]
    # a flipped byte in the manifest shows as the file whose recorded digest it changed
    assert event["corrupt_checkpoint"] == str(newest) and (name in event["reason"] or "manifest" in event["reason"])
    assert (newest.parent / "step_00000003.corrupt").is_dir()
    assert next(r for r in records if "resumed_from" in r)["resumed_from"].endswith("step_00000002")
    _assert_resumed_after(case, 2, full)
    _assert_bit_identical(full, case)


def test_two_ranks_resume_from_the_checkpoint_rank_0_chose(runs, tmp_path, config_factory):
    full = runs("w2", 2)
    case = _stopped_copy(runs, tmp_path, 2)
    _flip_a_byte(case / "out" / "checkpoints" / "step_00000003" / "trainer_state.pt")
    cfg = config_factory(case / "resume.yaml", case / "out", trace_dir=str(case / "trace"))
    run_local_ranks(str(cfg), [], 2, timeout_s=RANKS_TIMEOUT_S)
    _assert_resumed_after(case, 2, full)
    _assert_bit_identical(full, case)


def test_no_intact_checkpoint_left_is_one_clear_error(runs, config_factory, tmp_path, subprocess_env):
    case = _stopped_copy(runs, tmp_path, 1)
    ckpts = case / "out" / "checkpoints"
    for step in (1, 2, 3):
        _flip_a_byte(ckpts / f"step_{step:08d}" / "head.safetensors")
    cfg = config_factory(case / "resume.yaml", case / "out")
    p = subprocess.run([sys.executable, "-m", "jobs.train", "--config", str(cfg)], cwd=REPO, env=subprocess_env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("train: error:")]
    assert f"no intact checkpoint left in {ckpts}" in line and "keep_checkpoints" in line, p.stderr
    assert sorted(x.name for x in ckpts.iterdir()) == [f"step_{s:08d}.corrupt" for s in (1, 2, 3)]


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(runs, config_factory, tmp_path, capsys):
    """No manifest and no format mark in trainer_state.pt: written before manifests; the resume
    uses it (and says so). A current checkpoint that lost its manifest is incomplete instead."""
    full = runs("w1", 1)
    case = _stopped_copy(runs, tmp_path, 1)
    newest = case / "out" / "checkpoints" / "step_00000003"
    (newest / "manifest.json").unlink()
    state = torch.load(newest / "trainer_state.pt", weights_only=False)
    del state["format"]
    torch.save(state, newest / "trainer_state.pt")
    cfg = config_factory(case / "resume.yaml", case / "out", trace_dir=str(case / "trace"))
    capsys.readouterr()
    assert recipe_main(load_train_config(cfg)) == 0
    out = capsys.readouterr()
    assert "written before checkpoints had manifests" in out.err
    _assert_resumed_after(case, 3, full)
    _assert_bit_identical(full, case)
    older = case / "out" / "checkpoints" / "step_00000002"
    (older / "manifest.json").unlink()
    from hobson.decider.checkpoint import verify_checkpoint
    from hobson.manifest import ManifestMismatch

    with pytest.raises(ManifestMismatch, match="incomplete, no manifest.json"):
        verify_checkpoint(older)


@pytest.mark.parametrize("point", ["train-step-4", "train-checkpoint-4", "train-final"])
def test_sigterm_at_a_phase_then_a_rerun_ends_bit_identical(runs, config_factory, tmp_path, subprocess_env, point):
    """SIGTERM (the default action: the process dies on the spot) before step 4, after step 4
    before its checkpoint, and after the last checkpoint before final/: the rerun resumes from the
    newest checkpoint and ends with the uninterrupted run's adapter and head bytes."""
    full = runs("w1", 1)
    out = tmp_path / "run" / "out"
    cfg = config_factory(tmp_path / "train.yaml", out, trace_dir=str(tmp_path / "trace"), checkpoint_every=2)
    holds = tmp_path / "holds"
    env = {**subprocess_env, faults.ENV_POINTS: point, faults.ENV_DIR: str(holds)}
    proc = subprocess.Popen([sys.executable, "-m", "jobs.train", "--config", str(cfg)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    faults.wait_held(holds, point, 300, alive=lambda: proc.poll() is None)
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM and not (out / "final").exists()
    again = subprocess.run([sys.executable, "-m", "jobs.train", "--config", str(cfg)], cwd=REPO, env=subprocess_env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_bit_identical(full, tmp_path / "run")
