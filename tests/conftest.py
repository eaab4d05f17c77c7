"""Shared fixtures. The repository root and src/ are on sys.path (pyproject's pytest config)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    scrub = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMIX_", "PMI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(scrub) or k == "SLURM_CONF"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(*args: str, cwd: Path | None = None, check: bool = True, timeout: float = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python launch/submit.py ARGS`` in a fresh process, as a user would."""
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "submit.py"), *args], cwd=cwd or REPO,
                          env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"submit.py {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def subprocess_env():
    return _env()


@pytest.fixture(scope="session")
def recipe_all_local(tmp_path_factory):
    """`recipe all --ngpu 2 --backend local` once per session: (run_dir, logs_dir, stdout).

    The local end-to-end tests read it, and the Slurm tests compare their outputs with it.
    """
    base = tmp_path_factory.mktemp("recipe-all-local")
    run_dir = base / "run"
    proc = run_cli("recipe", "all", "--ngpu", "2", "--backend", "local", "--run-dir", str(run_dir),
                   "--logs-dir", str(base / "logs"), timeout=1800)
    return run_dir, base / "logs" / "run", proc.stdout

