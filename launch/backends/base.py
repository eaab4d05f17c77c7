"""The Backend interface, and what every backend shares: the job environment, what is
already done, failure reports, log files.

A backend is chosen once, from the registry in :mod:`hobson.launch.backends` (by name for a new run,
from the run record for an existing one); the launcher then calls only the :class:`Backend`
methods below, so nothing outside ``launch/backends/`` knows which backend runs a run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from hobson.io import sha256_file
from hobson.launch.dag import JobSpec
from hobson.records import RunPaths, latest_records, read_run_json, read_stage_records


@dataclass
class BackendOptions:
    """How a run asked for its backend; recorded in run.json, so any later command rebuilds the
    same backend from the record alone (:func:`hobson.launch.backends.for_run`)."""

    ngpu: int = 1
    cluster: str | None = None  # cluster profile YAML (slurm); None: configs/cluster/default.yaml
    partition: str | None = None
    account: str | None = None
    aws_config: str | None = None  # configs/aws.yaml when None
    allow_dirty: bool = False  # aws: ship uncommitted changes
    detach: bool = False  # aws: return once the host started the run


@dataclass
class Launch:
    """One launch of a run: its jobs in DAG order, and how to ask for them again elsewhere.

    ``host_argv()`` is the ``submit.py`` command line a remote host reruns with its local
    backend; a callable, because only a remote backend needs it and building it may refuse
    (a config file outside the repository never reaches the host).
    """

    paths: RunPaths
    jobs: list[JobSpec]
    host_argv: Callable[[], list[str]] = field(default=lambda: [])
    echo: Callable[[str], Any] = print


@dataclass
class Poll:
    """What a backend's scheduler says about a run's jobs (see :mod:`launch.status`)."""

    source: str  # where the states came from: "sacct+squeue", "record", ...
    states: dict[str, dict[str, str]] = field(default_factory=dict)  # job id (or id_task, id+k) -> fields
    unrecorded: str = "unknown"  # the state of a launched job that has no record yet
    note: str | None = None  # one line status adds (e.g. the launcher is gone)


class Backend(Protocol):
    """What the launcher asks of every backend, for recipe and RL runs alike."""

    name: ClassVar[str]
    options: BackendOptions
    waits: bool  # launch returns after the run ended (run here, or followed), not after submitting
    remote: bool  # jobs run on other machines than the launcher's: a server a job starts must listen beyond loopback

    def dry_run(self, launch: Launch) -> str:
        """Exactly what :meth:`launch` would run or submit; runs and submits nothing."""

    def launch(self, launch: Launch) -> int:
        """Run (local, aws) or submit (slurm) every unfinished job; 0, or the failing exit code."""

    def status(self, paths: RunPaths) -> str:
        """Lines about where the run stands that the record alone cannot say ('' when none); a
        remote backend mirrors the host's record into the run directory first."""

    def poll(self, meta: dict) -> Poll:
        """The scheduler's view of the run's recorded jobs, for the status table."""

    def logs(self, paths: RunPaths, job: str | None = None, task: int | None = None) -> str:
        """A job's log (one array task's with ``task``); no job: the run's log names, one per line."""

    def cancel(self, paths: RunPaths) -> str:
        """Stop the run's jobs; one line saying what was stopped."""

    def retry(self, launch: Launch) -> int:
        """Launch again what did not finish (finished jobs and shards are skipped by digest)."""


def component_states(meta: dict, launcher_alive: bool = True) -> dict[str, dict[str, str]]:
    """Poll states of the components a launcher that runs processes recorded (``component_ids``,
    ``component_states`` of a submission: the local backend, here or on the AWS host). A
    component recorded as running whose launcher is gone is "gone": its processes died with it."""
    states: dict[str, dict[str, str]] = {}
    for sub in meta.get("submissions", []):
        for cid, state in zip(sub.get("component_ids") or [], sub.get("component_states") or [], strict=False):
            if state in ("running", "starting", "waiting") and not launcher_alive:
                state = "gone"
            states[cid] = {"state": state, "node": sub.get("host", "")}
    return states


def _submissions(paths: RunPaths) -> list[dict]:
    return read_run_json(paths).get("submissions", []) if paths.run_json.exists() else []


def local_logs(paths: RunPaths, job: str | None = None, task: int | None = None) -> str:
    """Logs in the run's logs directory (the local and Slurm backends write them there)."""
    from hobson.errors import HobsonError

    # a job that named its own log (plain `sbatch sbatch/<alg>.sh`: its --output) recorded it
    recorded = {s["job"]: Path(s["log"]) for s in _submissions(paths) if s.get("log") and s.get("job")}
    if job is None:
        return "".join(f"{p}\n" for p in sorted({*paths.logs_dir.glob("*.log"), *recorded.values()}))
    log = recorded[job] if task is None and job in recorded and not paths.log(job).exists() else paths.log(job, task)
    if not log.exists():
        raise HobsonError(f"no log {log}; logs of this run: "
                          + (", ".join(p.name for p in sorted(paths.logs_dir.glob("*.log"))) or "none yet"))
    return log.read_text(errors="replace")

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
    # No PYTHONPATH: a job imports the installed hobson (hobson.jobs.<job> included) like the
    # launcher does, and a dotted test job module is found from the working directory, the checkout.
    env = scrubbed_environ()
    # Thread counts fixed per stage, so a CPU result does not depend on who ran it.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(job.resources.cpus)
    env["HOBSON_CPUS"] = str(job.resources.cpus)
    # The jobs of one host share its cores (an array's tasks at once, a stage beside the user's
    # other work): OpenMP threads that spin while they wait then take the cores the others need.
    # Two replay shards of 2 threads each on 2 cores labelled 3.6 batches/s spinning and 14 sleeping,
    # the same bytes (only how threads wait differs). The user's own setting wins.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
