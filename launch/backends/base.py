"""What every backend shares: the job environment, what is already done, failure reports."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hobson.io import sha256_file
from hobson.records import REPO_ROOT, RunPaths, latest_records, read_stage_records
from launch.dag import JobSpec

# Variables a submitting Slurm job would leak into the jobs it submits (submitit's complaint):
# a nested sbatch would otherwise inherit the outer allocation's ids and limits.
_SCRUB_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMIX_", "PMI_")
_KEEP = {"SLURM_CONF"}


def scrubbed_environ(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith(_SCRUB_PREFIXES) and k not in _KEEP:
            del env[k]
    return env


def job_environ(job: JobSpec, *, task: int | None = None, gpus: list[int] | None = None) -> dict[str, str]:
    """The environment a job runs in, identical in meaning on every backend."""
    env = scrubbed_environ()
    src = str(REPO_ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # Thread counts fixed per stage, so a CPU result does not depend on who ran it.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(job.resources.cpus)
    env["HOBSON_CPUS"] = str(job.resources.cpus)
    env["PYTHONUNBUFFERED"] = "1"
    if task is not None:
        env["HOBSON_ARRAY_TASK"] = str(task)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env


@dataclass
class Progress:
    """What the run record says about one job: finished shards (arrays) or done (single)."""

    done: bool
    pending_shards: list[int]


def _outputs_intact(record: dict, paths: RunPaths) -> bool:
    outs = record.get("outputs") or []
    for o in outs:
        p = paths.abs(o["path"])
        if not o.get("ok") or not p.exists() or sha256_file(p) != o["sha256"]:
            return False
    return bool(outs)


def job_progress(job: JobSpec, paths: RunPaths, records: list[dict] | None = None) -> Progress:
    latest = latest_records(read_stage_records(paths) if records is None else records)
    if job.shards is None:
        r = latest.get((job.name, None))
        done = bool(r and r["status"] == "ok" and _outputs_intact(r, paths))
        return Progress(done, [])
    pending = [s for s in job.shards
               if not ((r := latest.get((job.name, s))) and r["status"] == "ok" and _outputs_intact(r, paths))]
    return Progress(not pending, pending)


def recorded_absence(paths: RunPaths) -> Callable[[str], str | None]:
    """``absent(rel)``: None when the file exists with the digest the run recorded, else why not."""
    digests: dict[str, str] = {}
    for r in read_stage_records(paths):
        for o in r.get("outputs") or []:
            if o.get("sha256"):
                digests[o["path"]] = o["sha256"]

    def absent(rel: str) -> str | None:
        p = paths.abs(rel)
        if rel not in digests:
            return "no named stage produces it and the run has no record of it"
        if not p.exists():
            return f"the run recorded it but {p} is missing"
        actual = sha256_file(p)
        if actual != digests[rel]:
            return f"{p} differs from its record (recorded sha256 {digests[rel]}, now {actual})"
        return None

    return absent


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:])


def failure_report(job: JobSpec, logs: Iterable[Path], job_id: str | None = None) -> str:
    parts = [f"stage {job.name} failed" + (f" (job {job_id})" if job_id else "")]
    for log in logs:
        parts.append(f"--- last 40 lines of {log} ---\n{tail(log)}")
    return "\n".join(parts)
