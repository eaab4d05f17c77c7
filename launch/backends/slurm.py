"""The Slurm backend: one sbatch script per job, rendered by :func:`launch.sbatch.render_sbatch`.

Array stages become ``--array=0-(n-1)%throttle`` whose task k runs shard ``shards[k]`` (a retry
submits only the missing shards as a new, smaller array). Dependencies are ``afterok`` with
``--kill-on-invalid-dep=yes``, so a failed stage cancels its dependents instead of leaving
them pending forever. ``--dry-run`` prints the scripts exactly as they would be submitted, with
``{job:<name>}`` standing for the job ids that submission fills in.

Submission goes through submitit's executor (its sbatch call, job-id parsing and job folder),
with the script text replaced by ours, so what is submitted is byte for byte what we render.
Arrays longer than the cluster's ``MaxArraySize`` are split into several arrays; a job that
depends on the array waits for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hobson.errors import ConfigError, HobsonError
from hobson.launch.backends.base import BackendOptions, Launch, Poll, job_progress, local_logs, scrubbed_environ
from hobson.launch.dag import RL_ROLLOUT, RL_TRAINING, JobSpec
from hobson.launch.options import DEFAULT_CLUSTER, ClusterProfile
from hobson.launch.sbatch import render_sbatch
from hobson.records import REPO_ROOT, RunPaths, read_run_json, utc_now, write_run_json
from hobson.shards import format_spec


def _executor_class():
    import submitit

    class ScriptExecutor(submitit.SlurmExecutor):
        """submitit's Slurm executor submitting a script we rendered instead of its pickling one."""

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return command

        def _num_tasks(self) -> int:
            return 1

    return ScriptExecutor


def sbatch(script: str, folder: Path) -> Any:
    """Submit ``script`` byte for byte through submitit's executor (its sbatch call, job-id parsing
    and job folder); returns submitit's job (``.job_id``, ``.paths.submission_file``).

    The one place hobson reaches into submitit's private API: ``SlurmExecutor._submit_command``
    is what its public ``submit`` calls after pickling a function, and hobson submits a script,
    not a function. tests/launch/test_submitit_private_api.py fails if submitit changes it.
    """
    executor = _executor_class()(folder=folder)
    with _scrubbed_os_environ():
        return executor._submit_command(script)



def submit_script(script: str, paths: RunPaths, job: str, record: dict | None = None) -> str:
    """Submit ``script`` through :func:`sbatch` and append its submission (job name, id, script,
    and ``record``'s fields) to the run record: the one path every Slurm job of a run takes,
    recipe stages and the RL job alike. Returns the job id; sbatch's refusal is a HobsonError."""
    (paths.run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    paths.logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        sj = sbatch(script, paths.run_dir / "slurm")
    except Exception as e:  # submitit raises its own types; quote sbatch's answer
        raise HobsonError(f"sbatch refused job {job}: {e}") from None
    meta = read_run_json(paths)
    meta.setdefault("submissions", []).append(
        {"job": job, "backend": "slurm", "job_id": sj.job_id, "attempt": utc_now(),
         **(record or {}), "script": str(sj.paths.submission_file)})
    write_run_json(paths, meta)
    return str(sj.job_id)

@contextlib.contextmanager
def _scrubbed_os_environ() -> Iterator[None]:
    """sbatch exports the caller's environment; drop a surrounding job's SLURM_* ids and limits."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(scrubbed_environ(saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _torchrun_command(python: str, stagerun_argv: list[str], max_restarts: int, rdzv_address: str | None = None) -> str:
    """One srun task per node: the stage's torchrun agent (``stagerun --torchrun``); every node's
    agent meets the others at one c10d rendezvous, ``rdzv_address`` (default: the job's first node).

    The batch shell gets ``USR2`` before the time limit (``--signal=B:USR2@N``) or from
    ``scancel --signal=USR2 --batch``, and passes it to the job step, whose agents pass it to
    the ranks (torchrun itself dies on USR2). The ranks checkpoint and exit 75; the shell then
    requeues the job, at most ``max_restarts`` times, and the next attempt resumes from that
    checkpoint. The port comes from the job id so two training jobs sharing a host never collide.
    """
    run = shlex.join([python, *stagerun_argv])
    head = rdzv_address or '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    return "\n".join([
        f"head={head}",
        'export HOBSON_RDZV="$head:$(( 20000 + SLURM_JOB_ID % 20000 ))"',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {run} &",
        "step=$!",
        """trap 'echo "[hobson] USR2: passing it to the training step"; scancel --signal=USR2 "$SLURM_JOB_ID"' USR2""",
        'wait "$step"; rc=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; rc=$?; done  # a trapped signal interrupts wait',
        f'if [ "$rc" = 75 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_restarts} ]; then',
        f'  echo "[hobson] checkpointed after USR2: requeue (restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of '
        f'{max_restarts})"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
    ])


def spread_over_nodes(job: JobSpec, nodes: int | None) -> JobSpec:
    """``job`` with its ranks spread over ``nodes`` nodes (the cluster profile's
    ``stages.<stage>.nodes``): ``resources.gpus`` ranks in all, ``gpus // nodes`` on each node.
    Only torchrun stages span nodes, and only a whole number of ranks per node."""
    if not nodes or nodes == job.resources.nodes:
        return job
    key = f"stages.{job.stage}.nodes"
    if job.launcher != "torchrun" or job.is_array:
        raise ConfigError(f"{key}: {nodes}: only the torchrun training stages (parent, train) run on several "
                          f"nodes; {job.name} is one process on one node")
    ranks = job.resources.gpus
    if ranks % nodes:
        raise ConfigError(f"{key}: {nodes} does not divide the {ranks} ranks (--ngpu {ranks}); use a divisor "
                          f"of --ngpu, or --ngpu {nodes * max(ranks // nodes, 1)}")
    return dataclasses.replace(job, resources=dataclasses.replace(job.resources, nodes=nodes, gpus=ranks // nodes))


def _client(cmd: list[str], env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess | None:
    """A Slurm client call that can neither hang a poll nor crash it: None when it cannot answer."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def max_array_size() -> int:
    """``MaxArraySize`` from ``scontrol show config`` (task ids run 0..MaxArraySize-1)."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.strip().startswith("MaxArraySize"):
            return int(line.split("=", 1)[1].strip())
    return 1001  # Slurm's documented default


class SlurmBackend:
    name = "slurm"
    waits = False  # launch submits; status follows
    remote = True

    def __init__(self, profile: ClusterProfile, ngpu: int, options: BackendOptions | None = None) -> None:
        self.profile = profile
        self.ngpu = ngpu
        self.options = options or BackendOptions(ngpu=ngpu, partition=profile.partition, account=profile.account)

    @classmethod
    def from_options(cls, options: BackendOptions) -> SlurmBackend:
        """The cluster profile YAML of ``options`` (validated), its partition and account overridden."""
        from hobson.config import load_config

        prof = load_config(options.cluster or DEFAULT_CLUSTER, ClusterProfile)
        prof.partition = options.partition or prof.partition
        prof.account = options.account or prof.account
        return cls(prof, options.ngpu, options)

    # ----------------------------------------------------------------------------------------
    # the Backend interface

    def launch(self, launch: Launch) -> int:
        ids = self.submit(launch.jobs, launch.paths, launch.echo)
        launch.echo(f"submitted {sum(len(v) for v in ids.values())} Slurm jobs for run {launch.paths.run_dir.name}: "
                    + ", ".join(f"{k}={'+'.join(v)}" for k, v in ids.items()))
        launch.echo(f"  status : python launch/submit.py status {launch.paths.run_dir}")
        return 0

    def retry(self, launch: Launch) -> int:
        return self.launch(launch)  # submit skips finished jobs and shards by digest

    def status(self, paths: RunPaths) -> str:
        return ""  # status.render polls the scheduler for every recorded job id

    def logs(self, paths: RunPaths, job: str | None = None, task: int | None = None) -> str:
        return local_logs(paths, job, task)

    def poll(self, meta: dict) -> Poll:
        source, states = self.query(self.job_ids(meta))
        return Poll(source, states)

    # ----------------------------------------------------------------------------------------
    # rendering

    def render(self, job: JobSpec, paths: RunPaths, dep_ids: dict[str, list[str]] | None = None,
               shards: list[int] | None = None) -> str:
        """The sbatch script for ``job``; ``shards`` narrows an array (a retry, or one split part).

        ``dep_ids`` maps the jobs submitted so far to their Slurm ids; a dependency missing from
        it finished earlier (no edge needed). ``None`` renders ``{job:<name>}`` placeholders.
        """
        prof = self.profile
        over = prof.stages.get(job.stage)
        job = spread_over_nodes(job, over.nodes if over else None)
        res = job.resources
        cpus = over.cpus if over and over.cpus else res.cpus
        mem_gb = over.mem_gb if over and over.mem_gb else res.mem_gb
        time_limit = over.time if over and over.time else res.time
        argv = job.stagerun_args(str(paths.run_dir), shards)
        array = None
        if job.is_array:
            shards = job.shards if shards is None else shards
            throttle = min(job.throttle or len(shards), len(shards))
            array = f"0-{len(shards) - 1}%{throttle}"
        setup = [
            # the checkout: relative paths in job arguments, and `python -m` puts it on sys.path for
            # a dotted test job module; hobson itself is the profile python's install (no PYTHONPATH)
            f"cd {shlex.quote(str(REPO_ROOT))}",
            f"export OMP_NUM_THREADS={cpus} MKL_NUM_THREADS={cpus} OPENBLAS_NUM_THREADS={cpus} HOBSON_CPUS={cpus}",
            "export PYTHONUNBUFFERED=1",
        ]
        if job.is_array:
            setup.append("export HOBSON_ARRAY_TASK=$SLURM_ARRAY_TASK_ID")
        setup += list(prof.setup)
        if job.launcher == "torchrun":
            if prof.socket_ifname:  # the interface(s) the ranks' collectives use, on every node
                setup.append(f"export GLOO_SOCKET_IFNAME={prof.socket_ifname} NCCL_SOCKET_IFNAME={prof.socket_ifname}")
            command = _torchrun_command(prof.python, argv, prof.max_restarts, prof.rdzv_address)
            # each requeued attempt logs to its own file
            attempt_log = f'{paths.logs_dir / job.name}.attempt${{SLURM_RESTART_COUNT}}.log'
            setup.append(f'[ "${{SLURM_RESTART_COUNT:-0}}" -eq 0 ] || exec >>"{attempt_log}" 2>&1')
        else:
            command = "exec " + shlex.join([prof.python, *argv])
        if dep_ids is None:
            deps = [f"{{job:{a}}}" for a in job.after]
        else:
            deps = [i for a in job.after for i in dep_ids.get(a, [])]
        log = paths.logs_dir / (f"{job.name}_%a.log" if job.is_array else f"{job.name}.log")
        return render_sbatch(
            command,
            job_name=f"hobson-{paths.run_dir.name}-{job.name}",
            output=str(log),
            array=array,
            nodes=res.nodes,
            gpus_per_node=res.gpus,
            cpus_per_task=cpus * max(res.gpus, 1) if job.launcher == "torchrun" else cpus,
            mem=f"{mem_gb}G",
            time=time_limit,
            partition=prof.partition,
            account=prof.account,
            qos=prof.qos,
            constraint=prof.constraint,
            exclusive=prof.exclusive,
            dependency=("afterok:" + ":".join(deps)) if deps else None,
            signal=f"B:USR2@{prof.signal_seconds}" if job.launcher == "torchrun" else None,
            requeue=job.launcher == "torchrun",
            extra=tuple(prof.extra_sbatch),
            setup=tuple(setup),
        )

    def render_components(self, job: JobSpec, paths: RunPaths) -> str:
        """The script of a job of several components (the RL run): one heterogeneous job, the
        training component first (``+0``), the rollout component second (``+1``); ``colocated``
        puts both on one node. The same job as ``sbatch/<algorithm>.sh``."""
        from hobson.launch.backends.slurm_scripts import script_for_profile

        over = self.profile.stages.get(job.stage)  # the cluster profile's stage override, per component
        res = {c.name: c.resources for c in job.parts}
        train, rollout = res[RL_TRAINING], res[RL_ROLLOUT]

        def pick(field: str, r: object) -> object:
            return getattr(over, field, None) or getattr(r, field)

        return script_for_profile(
            job.job_args, self.profile, str(paths.log(job.name)), colocated=job.colocated,
            train_gpus=train.gpus, rollout_gpus=rollout.gpus, time=pick("time", train),
            train_cpus=pick("cpus", train), rollout_cpus=pick("cpus", rollout),
            train_mem=f"{pick('mem_gb', train)}G", rollout_mem=f"{pick('mem_gb', rollout)}G",
        )

    def dry_run(self, launch: Launch | list[JobSpec], paths: RunPaths | None = None) -> str:
        jobs, paths = (launch.jobs, launch.paths) if isinstance(launch, Launch) else (launch, paths)
        if len(jobs) == 1 and jobs[0].heterogeneous:
            return self.render_components(jobs[0], paths)
        parts = []
        for n, job in enumerate(jobs, 1):
            head = f"# ===== job {n}/{len(jobs)}: {job.name} (stage {job.stage})"
            if job.is_array:
                head += f"; array of {len(job.shards)} tasks, task k runs shard k of {job.num_shards}"
            head += "; after: " + (", ".join(job.after) if job.after else "-")
            parts.append(f"{head}\n# sbatch --parsable <script below>\n{self.render(job, paths)}")
        return "\n".join(parts)

    # ----------------------------------------------------------------------------------------
    # submission

    def submit(self, jobs: list[JobSpec], paths: RunPaths, echo=print) -> dict[str, list[str]]:
        """Submit every unfinished job in DAG order; return ``{job name: [slurm job ids]}``."""
        for job in jobs:  # a bad stage override is one error before anything is submitted
            over = self.profile.stages.get(job.stage)
            spread_over_nodes(job, over.nodes if over else None)
        limit = max_array_size()
        attempt = utc_now()
        ids: dict[str, list[str]] = {}
        paths.logs_dir.mkdir(parents=True, exist_ok=True)
        for job in jobs:
            progress = job_progress(job, paths)
            if progress.done:
                echo(f"[{job.name}] already done with matching digests: skipped")
                continue
            pending = progress.pending_shards if job.is_array else None
            parts = [pending[i: i + limit] for i in range(0, len(pending), limit)] if job.is_array else [None]
            ids[job.name] = []
            for part in parts:
                script = self.render_components(job, paths) if job.heterogeneous else self.render(job, paths, ids, part)
                sub: dict = {"attempt": attempt}
                if part is not None:
                    sub.update(shards=format_spec(part), tasks=len(part))
                if job.heterogeneous:  # one Slurm job; its components are <id>+0, <id>+1 (one id when colocated)
                    sub.update(components=[c.name for c in job.parts], colocated=job.colocated)
                try:
                    job_id = submit_script(script, paths, job.name, sub)
                except HobsonError as e:
                    # a chain with a missing link would only half run: take back what this call submitted
                    submitted = [i for v in ids.values() for i in v]
                    if submitted:
                        _client(["scancel", *submitted], scrubbed_environ())
                    raise HobsonError(str(e) + (f"\ncancelled the jobs already submitted: {', '.join(submitted)}"
                                                if submitted else "")) from None
                ids[job.name].append(job_id)
                echo(f"[{job.name}] submitted job {job_id}"
                     + (f" (array of {len(part)} tasks: shards {format_spec(part)})" if part is not None else ""))
        return ids

    # ----------------------------------------------------------------------------------------
    # state

    @staticmethod
    def job_ids(meta: dict) -> list[str]:
        return [s["job_id"] for s in meta.get("submissions", []) if s.get("backend") == "slurm"]

    @staticmethod
    def query(job_ids: list[str]) -> tuple[str, dict[str, dict[str, str]]]:
        """One poll for the whole run: ``(source, {jobid or jobid_task: fields})``.

        One ``squeue -t all`` call gives slurmctld's current view (it knows jobs until MinJobAge
        after they end, and sees a cancellation at once); one ``sacct`` call gives history
        (accounting lags the controller by a moment). Controller states win; without accounting
        squeue alone answers; without either, the caller falls back to the run record. A slurmctld
        that `scontrol ping` reports DOWN is not asked (sacct answers alone, the source says so).
        Two calls per poll however many jobs and array tasks the run has.
        """
        if not job_ids:
            return "none", {}
        env = scrubbed_environ()
        rows: dict[str, dict[str, str]] = {}
        sources = []
        fmt = "JobID,JobName%60,State,Elapsed,NodeList,ExitCode,AllocTRES%80"
        r = _client(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), f"--format={fmt}"], env)
        if r and r.returncode == 0:
            sources.append("sacct")
            for line in r.stdout.splitlines():
                f = line.split("|")
                if len(f) >= 7:
                    rows[f[0]] = {"state": f[2].split()[0] if f[2] else "", "elapsed": f[3], "node": f[4],
                                  "exit": f[5], "tres": f[6]}
        # A stopped slurmctld: `scontrol ping` says so at once, while squeue retries its connection
        # for MessageTimeout (9-18 s measured) before it gives up; accounting alone answers then.
        ping = _client(["scontrol", "ping"], env, timeout=10)
        if ping is not None and ping.returncode != 0 and "DOWN" in ping.stdout:
            return ("+".join(sources) or "record") + " (slurmctld DOWN)", rows
        r = _client(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%M|%N"], env)
        if r and (r.returncode == 0 or "Invalid job id" in r.stderr):  # every job already past MinJobAge
            sources.append("squeue")
            for line in r.stdout.splitlines():
                f = line.split("|")
                if len(f) >= 4:
                    row = rows.setdefault(f[0], {"exit": "", "tres": ""})
                    row.update(state=f[1], elapsed=f[2], node=f[3] or row.get("node", ""))
        return ("+".join(sources) or "record"), rows

    def cancel(self, paths: RunPaths) -> str:
        ids = self.job_ids(read_run_json(paths))
        if not ids:
            return "no Slurm jobs recorded for this run"
        r = subprocess.run(["scancel", *ids], capture_output=True, text=True, check=False, env=scrubbed_environ())
        if r.returncode != 0:
            raise HobsonError(f"scancel {' '.join(ids)} failed: {r.stderr.strip()}")
        return f"cancelled jobs {', '.join(ids)}"


def submission_script(sub: dict) -> Path | None:
    p = sub.get("script")
    return Path(p) if p else None
