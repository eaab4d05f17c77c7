"""The decider recipe on GPUs under ``torchrun`` (NCCL): equal to one GPU in fp32; bf16 runs and resumes.

GPU kernels are not bit-deterministic (index backward accumulates atomically), so this checks
gradients to 1e-4 relative rather than bit equality; the bit-exact checks run on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _train(cfg: Path, env: dict, nproc: int, *overrides: str) -> list[dict]:
    launcher = ([sys.executable, "-m", "jobs.train"] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                 "-m", "jobs.train"])
    proc = subprocess.run([*launcher, "--config", str(cfg), "device=cuda", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]


def test_two_gpus_equal_one_gpu_fp32(config_factory, tmp_path, subprocess_env):
    one = tmp_path / "one"
    two = tmp_path / "two"
    _train(config_factory(tmp_path / "a.yaml", one / "out", trace_dir=str(one / "trace")), subprocess_env, 1)
    _train(config_factory(tmp_path / "b.yaml", two / "out", trace_dir=str(two / "trace")), subprocess_env, 2)
    for step in range(1, 11):
        g1 = torch.load(one / "trace" / f"grads_step{step:04d}.pt")
        g2 = torch.load(two / "trace" / f"grads_step{step:04d}.pt")
        rel = float((g1 - g2).norm() / g1.norm())
        assert rel < 1e-4, f"step {step}: {rel:.2e}"
        tokens = [{}, {}]
        for k, d in enumerate((one, two)):
            for f in (d / "trace").glob(f"tokens_step{step:04d}_rank*.json"):
                tokens[k].update(json.loads(f.read_text()))
        assert tokens[0] == tokens[1]


def test_bf16_gradient_checkpointing_two_gpus_stop_and_resume(config_factory, tmp_path, subprocess_env):
    cfg = config_factory(tmp_path / "c.yaml", tmp_path / "out", bf16=True, gradient_checkpointing=True)
    first = _train(cfg, subprocess_env, 2, "stop_after_steps=4")
    assert {"stopped_after_step": 4} in first
    second = _train(cfg, subprocess_env, 2)
    steps = [r["step"] for r in second if "loss" in r]
    assert steps == list(range(5, 11)) and all(torch.isfinite(torch.tensor(r["loss"])) for r in second if "loss" in r)
    assert (tmp_path / "out" / "final" / "adapter.safetensors").is_file()
