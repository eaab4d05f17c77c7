"""Shared fixtures. The repository root and src/ are on sys.path (pyproject's pytest config)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist (the README's `-n 2`) each worker, and every process it starts, computes on one
# thread: two workers of torch's default two threads each spin on the two cores' OpenMP barriers
# (a module fixture took 217 s instead of 34). The same count everywhere also keeps in-process and
# subprocess results comparable bit for bit. Set before this worker imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
# Every process the tests start (stages on the local backend, Slurm jobs of the one-machine cluster,
# RL components) shares the same two cores with the other worker: its OpenMP threads sleep while
# they wait instead of spinning (spinning made two 2-thread replay shards 4x slower; the bytes are
# the same either way). Slurm jobs inherit it from the submitting environment.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _env() -> dict[str, str]:
    scrub = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMIX_", "PMI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(scrub) or k == "SLURM_CONF"}
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


# The decider fixtures, shared by tests/decider, tests/serve, tests/slurm and tests/bench: built once
# per session (tests/decider/conftest.py holds what they are built from).
@pytest.fixture(scope="session")
def decider_data(tmp_path_factory) -> dict[str, Path]:
    from hobson.io import dumps_row
    from tests.decider.conftest import build_tiny_torso, make_rows, teacher_lines

    root = tmp_path_factory.mktemp("decider")
    rows = make_rows()
    train = root / "train.jsonl"
    train.write_text("".join(dumps_row(r) + "\n" for r in rows), encoding="utf-8")
    teacher = root / "teacher.jsonl"
    teacher.write_text("".join(dumps_row(t) + "\n" for t in teacher_lines(rows)), encoding="utf-8")
    val = root / "val.jsonl"
    val.write_text("".join(dumps_row(r) + "\n" for r in make_rows(9, seed=5)), encoding="utf-8")
    texts = [r["state"] + " " + r["instructions"] + " " + " ".join(a + " " + b for a, b in r["options"])
             for r in rows] + ["Answer: A B C D E"]
    build_tiny_torso(root / "torso", texts)
    return {"root": root, "train": train, "teacher": teacher, "val": val, "torso": root / "torso"}


@pytest.fixture(scope="session")
def config_factory(decider_data):
    """``make(path, output_dir, **overrides) -> path`` writes a training config YAML."""
    from tests.decider.conftest import base_config, write_config

    def make(path: Path, output_dir: Path, **over) -> Path:
        return write_config(path, base_config(decider_data, output_dir, **over))
    return make


@pytest.fixture(scope="session")
def calibrated(config_factory, decider_data, tmp_path_factory) -> Path:
    """A tiny decider trained for one epoch and calibrated (a temperature per kind) by the real jobs."""
    import json

    from hobson.decider.config import load_train_config
    from hobson.decider.train import recipe_main
    from hobson.jobs import calibrate

    root = tmp_path_factory.mktemp("serve-ckpt")
    cfg = config_factory(root / "train.yaml", root / "train", epochs=1, kl_frozen_weight=0.0)
    assert recipe_main(load_train_config(cfg)) == 0
    out = root / "calibrated"
    assert calibrate.main(["--checkpoint", str(root / "train" / "final"), "--eval-files", str(decider_data["train"]),
                           str(decider_data["val"]), "--out", str(out), "--min-kind-rows", "3", "--threads", "1"]) == 0
    temps = json.loads((out / "temperatures.json").read_text())
    assert set(temps["per_kind"]) == {"choice", "noul", "score"}  # every kind has its own temperature
    return out


# pytest-xdist, as the README runs the tests (`-n 2 --dist loadgroup`): the tests that can reach
# the one local Slurm cluster (node downs, requeues and accounting are cluster-wide; `submit.py`
# picks Slurm wherever sbatch is on PATH) or read the session's `recipe all` run go to one worker,
# in their order and first, since they are the longest share; every other file goes whole to one
# worker, so its module and session fixtures are built once there. Without -n nothing changes.
# tests/launch runs submit.py with and without --backend (NAMED_LOCAL: its files that always name
# it); tests/aws, tests/serve and the top-level files name theirs (local or aws) or only ask for
# --help and status, so they may run beside it
SERIAL_DIRS = ("slurm", "launch")
# the launch files whose every run names --backend local (and whose status/logs/retry read that
# run's record): they leave the serial worker, which is CI's longest share
NAMED_LOCAL = {"launch/test_rl_components.py", "launch/test_rl_launch.py", "launch/test_local_backend.py"}


def _serial(item: pytest.Item) -> bool:
    rel = Path(str(item.path)).resolve().relative_to(REPO / "tests")
    if rel.as_posix() in NAMED_LOCAL:
        return False
    return rel.parts[0] in SERIAL_DIRS or "recipe_all_local" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set in the workers of --dist loadgroup
        return
    serial = [i for i in items if _serial(i)]
    rest = [i for i in items if not _serial(i)]
    for item in serial:
        item.add_marker(pytest.mark.xdist_group("serial"))
    for item in rest:
        item.add_marker(pytest.mark.xdist_group(str(Path(str(item.path)).resolve().relative_to(REPO))))
    items[:] = serial + rest
