"""The backends, one class each, chosen once from :data:`REGISTRY`.

``create(name, options)`` builds the backend of a new run; ``for_run(paths)`` rebuilds the
backend an existing run recorded, from its run.json alone. The launcher calls nothing else here,
so adding a backend means one class implementing :class:`hobson.launch.backends.base.Backend` and one
entry below.
"""

from __future__ import annotations

import importlib
import shutil
from dataclasses import asdict, fields

from hobson.errors import HobsonError
from hobson.launch.backends.base import Backend, BackendOptions
from hobson.records import RunPaths, read_run_json

# name -> "module:Class"; imported on use (the aws backend needs boto3, the [aws] extra)
REGISTRY: dict[str, str] = {
    "local": "hobson.launch.backends.local:LocalBackend",
    "slurm": "hobson.launch.backends.slurm:SlurmBackend",
    "aws": "hobson.launch.backends.aws:AwsBackend",
}
NAMES = tuple(REGISTRY)


def default_name() -> str:
    """slurm where sbatch is on PATH, else local."""
    return "slurm" if shutil.which("sbatch") else "local"


def create(name: str | None, options: BackendOptions) -> Backend:
    """The backend ``name`` (None: :func:`default_name`) for ``options``."""
    name = name or default_name()
    if name not in REGISTRY:
        raise HobsonError(f"backend {name!r}: supported {', '.join(NAMES)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls).from_options(options)


def recorded_options(meta: dict) -> BackendOptions:
    """The options a run recorded (runs from before the record kept them: their launcher options)."""
    rec = meta.get("backend_options")
    if rec is None:
        opts = meta.get("options") or {}
        rec = {"ngpu": opts.get("ngpu", 1), "cluster": opts.get("cluster"), "partition": opts.get("partition"),
               "account": opts.get("account"), "aws_config": (meta.get("aws") or {}).get("config")}
    known = {f.name for f in fields(BackendOptions)}
    return BackendOptions(**{k: v for k, v in rec.items() if k in known})


def for_run(paths: RunPaths) -> Backend:
    """The backend that answers ``status``, ``logs``, ``cancel`` and ``retry`` for this run: the
    one its latest invocation used."""
    meta = read_run_json(paths)
    return create(meta.get("backend", "local"), recorded_options(meta))


def record(meta: dict, backend: Backend) -> dict:
    """``meta`` with the backend's name and options, which :func:`for_run` reads back."""
    meta["backend"] = backend.name
    meta["backend_options"] = asdict(backend.options)
    return meta
