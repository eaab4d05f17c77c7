"""Shared fixture: the default corpus built twice, each stage in its own ``python -m`` process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR_STAGES = ["build", "multistep", "generated", "adequacy", "catchall"]


def _env(hashseed: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = hashseed  # different salts: output must not depend on hash()
    return env


def _run_stage(stage: str, data_dir: Path, *extra: str, hashseed: str = "0") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"jobs.{stage}", "--data-dir", str(data_dir), *extra],
        cwd=REPO, env=_env(hashseed), capture_output=True, text=True, check=False,
    )


@pytest.fixture
def run_stage() -> Callable[..., subprocess.CompletedProcess]:
    """``run_stage(stage, data_dir, *flags)``: ``python -m jobs.<stage>`` in a fresh process."""
    return _run_stage


@pytest.fixture(scope="session")
def two_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two data dirs, each built by separate processes (run concurrently: 2 cores)."""
    dirs = [tmp_path_factory.mktemp("corpus_a"), tmp_path_factory.mktemp("corpus_b")]
    procs = []
    for d, salt in zip(dirs, ("1", "2"), strict=True):
        for stage in [*GENERATOR_STAGES, "fetch"]:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", f"jobs.{stage}", "--data-dir", str(d)],
                cwd=REPO, env=_env(salt), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{p.args}: exit {p.returncode}\n{out}\n{err}"
    return dirs[0], dirs[1]
