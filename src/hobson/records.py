"""Run records: the one place that knows a run's file names.

A run lives in ``runs/<run-id>/`` (``run.json``, ``stages.jsonl``, its outputs) and logs to
``logs/<run-id>/<stage>[_<task>].log``. ``status``, ``logs``, ``cancel``, ``retry`` and
``verify`` re-attach to a run from these files alone, from any shell.

``stages.jsonl`` gets one line per finished stage (or array task). Lines are appended with a
single ``write`` on an ``O_APPEND`` descriptor, so concurrent array tasks never interleave.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hobson.io import sha256_bytes, write_json_atomic

# The checkout: src/hobson/records.py two folders up. The launcher, the jobs and the AWS runner take
# configs/, data/, sbatch/ and the git revision from here; an editable install (``pip install -e``,
# the README's set-up) keeps this file in the checkout, so it stays right however hobson is imported.
REPO_ROOT = Path(__file__).resolve().parents[2]


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_run_id() -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{os.urandom(2).hex()}"


@dataclass(frozen=True)
class RunPaths:
    """Names of everything a run writes. Output paths in records are relative to ``run_dir``."""

    run_dir: Path
    logs_dir: Path

    @classmethod
    def create(cls, run_dir: str | os.PathLike, logs_root: str | os.PathLike | None = None) -> RunPaths:
        run_dir = Path(run_dir).resolve()
        logs_root = Path(logs_root) if logs_root else Path.cwd() / "logs"
        return cls(run_dir, (logs_root / run_dir.name).resolve())

    @classmethod
    def attach(cls, run: str | os.PathLike) -> RunPaths:
        """Find a run by directory or by id under ``./runs``; its logs dir comes from run.json."""
        p = Path(run)
        if not (p / "run.json").exists() and (Path("runs") / run / "run.json").exists():
            p = Path("runs") / run
        if not (p / "run.json").exists():
            from hobson.errors import HobsonError

            raise HobsonError(f"no run at {run!r}: expected {p / 'run.json'} (pass a run directory or id)")
        meta = json.loads((p / "run.json").read_text())
        return cls(p.resolve(), Path(meta["logs_dir"]))

    @property
    def run_json(self) -> Path:
        return self.run_dir / "run.json"

    @property
    def stages_jsonl(self) -> Path:
        return self.run_dir / "stages.jsonl"

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    def log(self, stage: str, task: int | None = None, attempt: int | None = None) -> Path:
        name = stage if task is None else f"{stage}_{task}"
        if attempt:
            name += f".attempt{attempt}"
        return self.logs_dir / f"{name}.log"

    def abs(self, rel: str) -> Path:
        return self.run_dir / rel


# ---------------------------------------------------------------------------------------------
# run.json


def git_info(repo: Path = REPO_ROOT) -> dict[str, Any]:
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
        return r.stdout if r.returncode == 0 else ""

    rev = git("rev-parse", "HEAD").strip() or None
    diff = git("diff", "HEAD")
    return {"revision": rev, "dirty": bool(diff), "diff_sha256": sha256_bytes(diff.encode()) if diff else None}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for mod in ("hobson", "torch", "transformers", "peft", "numpy", "submitit", "deepspeed", "vllm"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:
            out[mod] = None
    return out


def new_run_json(paths: RunPaths, *, argv: list[str], backend: str, options: dict[str, Any],
                 config_digests: dict[str, str]) -> dict[str, Any]:
    return {
        "run_id": paths.run_dir.name,
        "run_dir": str(paths.run_dir),
        "logs_dir": str(paths.logs_dir),
        "created_utc": utc_now(),
        "command": argv,
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "backend": backend,
        "options": options,
        "git": git_info(),
        "config_digests": config_digests,
        "versions": versions(),
        "submissions": [],
    }


def read_run_json(paths: RunPaths) -> dict[str, Any]:
    return json.loads(paths.run_json.read_text())


def write_run_json(paths: RunPaths, meta: dict[str, Any]) -> None:
    write_json_atomic(paths.run_json, meta)


# ---------------------------------------------------------------------------------------------
# stages.jsonl


def append_stage_record(paths: RunPaths, record: dict[str, Any]) -> None:
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.stages_jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_stage_records(paths: RunPaths) -> list[dict[str, Any]]:
    if not paths.stages_jsonl.exists():
        return []
    out = []
    with open(paths.stages_jsonl, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"warning: {paths.stages_jsonl}: skipping a torn line", file=sys.stderr)
    return out


def latest_records(records: list[dict[str, Any]]) -> dict[tuple[str, int | None], dict[str, Any]]:
    """The last record per (stage, shard): later attempts override earlier ones."""
    out: dict[tuple[str, int | None], dict[str, Any]] = {}
    for r in records:
        out[(r["stage"], r.get("shard"))] = r
    return out
