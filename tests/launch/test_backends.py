"""One Backend interface: every backend in the registry implements it, the launcher calls nothing
else, and a run's later commands rebuild its backend from the record alone.

The methods are exercised here on the local backend; on Slurm through the launcher on the real
cluster (tests/slurm/test_recipe_slurm.py, tests/slurm/test_rl_slurm.py), on AWS in
tests/aws/test_aws_backend_protocol.py (moto over HTTP)."""

from __future__ import annotations

import ast
import importlib
import inspect
import json

import pytest

from hobson.launch import backends
from hobson.launch.backends.base import Backend, BackendOptions, Launch
from hobson.launch.dag import JobSpec, Resources
from hobson.records import RunPaths, new_run_json, read_run_json, write_run_json
from tests.conftest import REPO

METHODS = [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")]
BACKEND_NAMES = set(backends.NAMES)
BACKEND_CLASSES = {"LocalBackend", "SlurmBackend", "AwsBackend"}


def test_protocol_has_the_issue_methods():
    assert {"dry_run", "launch", "status", "logs", "cancel", "retry", "poll"} == set(METHODS)


@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
def test_every_registered_backend_implements_every_method(name):
    module, cls_name = backends.REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    assert cls.name == name
    assert callable(cls.from_options)
    for m in METHODS:
        impl = getattr(cls, m, None)
        assert callable(impl), f"{cls_name} lacks {m}"
        want = [p for p in inspect.signature(getattr(Backend, m)).parameters if p != "self"]
        have = [p for p in inspect.signature(impl).parameters if p != "self"]
        assert have[: len(want)] == want, (cls_name, m, have, want)  # the Protocol's names, in order


def _names_a_backend(path) -> list[str]:
    """Comparisons with a backend's name, and references to a backend class or module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                if isinstance(c, ast.Constant) and c.value in BACKEND_NAMES:
                    found.append(f"line {node.lineno}: compares with {c.value!r}")
        elif isinstance(node, ast.Name | ast.Attribute):
            ident = node.id if isinstance(node, ast.Name) else node.attr
            if ident in BACKEND_CLASSES:
                found.append(f"line {node.lineno}: {ident}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in BACKEND_CLASSES]
            for m in mods:
                if m in {f"hobson.launch.backends.{n}" for n in BACKEND_NAMES}:
                    found.append(f"line {node.lineno}: imports {m}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in {f"hobson.launch.backends.{n}" for n in BACKEND_NAMES}:
                    found.append(f"line {node.lineno}: imports {a.name}")
    return found


def test_launcher_and_jobs_never_name_a_backend():
    files = [REPO / "launch" / "submit.py", REPO / "launch" / "status.py", *sorted((REPO / "jobs").glob("*.py"))]
    offenders = {str(f.relative_to(REPO)): hits for f in files if (hits := _names_a_backend(f))}
    assert offenders == {}


def test_the_check_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('from hobson.launch.backends.slurm import SlurmBackend\nif meta["backend"] == "aws":\n    pass\n')
    assert len(_names_a_backend(bad)) == 3


def test_unknown_backend_is_one_clear_error():
    from hobson.errors import HobsonError

    with pytest.raises(HobsonError, match="backend 'pbs': supported local, slurm, aws"):
        backends.create("pbs", BackendOptions())


# ---------------------------------------------------------------------------------------------
# every method, on the local backend

JOB = "tests.launch.sample_jobs"


def _run(tmp_path, ngpu=2):
    paths = RunPaths.create(tmp_path / "run", tmp_path / "logs")
    paths.run_dir.mkdir(parents=True)
    be = backends.create("local", BackendOptions(ngpu=ngpu))
    write_run_json(paths, backends.record(new_run_json(paths, argv=["test"], backend=be.name, options={},
                                                       config_digests={}), be))
    job = JobSpec(name="one", stage="one", job=JOB, job_args=["--out", f"{paths.run_dir}/one.json"], inputs=[],
                  outputs=["one.json"], resources=Resources(cpus=1))
    return paths, Launch(paths, [job], echo=lambda s: None)


def test_local_backend_every_method(tmp_path):
    paths, launch = _run(tmp_path)
    be = backends.for_run(paths)  # rebuilt from the record alone
    assert be.name == "local" and be.options == BackendOptions(ngpu=2) and be.waits
    assert "hobson.stagerun" in be.dry_run(launch) and not (paths.run_dir / "one.json").exists()
    assert be.launch(launch) == 0
    assert json.loads((paths.run_dir / "one.json").read_text())["omp"] == "1"
    assert be.status(paths) == ""
    poll = be.poll(read_run_json(paths))
    assert poll.source == "record" and poll.unrecorded == "not run"  # the launcher has ended
    assert be.logs(paths).split() == [str(paths.log("one"))]
    assert "[hobson] stage one ok" in be.logs(paths, "one")
    assert be.cancel(paths) == "nothing to cancel: the run's local launcher is not running"
    before = (paths.run_dir / "one.json").stat().st_mtime_ns
    assert be.retry(launch) == 0  # finished: skipped by its recorded digest
    assert (paths.run_dir / "one.json").stat().st_mtime_ns == before


def test_status_and_retry_go_through_the_recorded_backend(cli, tmp_path):
    run_dir = tmp_path / "run"
    cli("recipe", "build", "--backend", "local", "--run-dir", str(run_dir), "--logs-dir", str(tmp_path / "logs"))
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["backend"] == "local" and meta["backend_options"]["ngpu"] == 1
    out = cli("status", str(run_dir)).stdout
    assert "backend local" in out and " ok " in out
    assert "nothing left to run" in cli("retry", str(run_dir)).stdout
    assert "not running" in cli("cancel", str(run_dir)).stdout
    assert "build" in cli("logs", str(run_dir)).stdout
