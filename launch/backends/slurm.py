"""The Slurm backend: one sbatch script per job, rendered by :func:`launch.sbatch.render_sbatch`.

Array stages become ``--array=0-(n-1)%throttle`` whose task k runs shard ``shards[k]`` (a retry
submits only the missing shards as a new, smaller array). Dependencies are ``afterok`` with
``--kill-on-invalid-dep=yes``, so a failed stage cancels its dependents instead of leaving
them pending forever. ``--dry-run`` prints the scripts exactly as they would be submitted, with
``{job:<name>}`` standing for the job ids that submission would fill in.
"""

from __future__ import annotations

import shlex

from hobson.records import REPO_ROOT, RunPaths
from hobson.shards import format_spec
from launch.dag import JobSpec
from launch.options import ClusterProfile
from launch.sbatch import render_sbatch


class SlurmBackend:
    name = "slurm"

    def __init__(self, profile: ClusterProfile, ngpu: int) -> None:
        self.profile = profile
        self.ngpu = ngpu

    def render(self, job: JobSpec, paths: RunPaths, dep_ids: dict[str, str],
               shards: list[int] | None = None) -> str:
        """The sbatch script for ``job``; ``shards`` narrows an array to the ones still missing."""
        prof = self.profile
        over = prof.stages.get(job.stage)
        res = job.resources
        cpus = (over.cpus if over and over.cpus else res.cpus)
        mem_gb = (over.mem_gb if over and over.mem_gb else res.mem_gb)
        time_limit = (over.time if over and over.time else res.time)
        argv = job.stagerun_args(str(paths.run_dir))
        array = None
        if job.is_array:
            shards = job.shards if shards is None else shards
            argv[argv.index("--shards") + 1] = format_spec(shards)
            throttle = min(job.throttle or len(shards), len(shards))
            array = f"0-{len(shards) - 1}%{throttle}"
        setup = [
            f"cd {shlex.quote(str(REPO_ROOT))}",
            f'export PYTHONPATH={shlex.quote(str(REPO_ROOT))}:{shlex.quote(str(REPO_ROOT / "src"))}'
            '${PYTHONPATH:+:$PYTHONPATH}',
            f"export OMP_NUM_THREADS={cpus} MKL_NUM_THREADS={cpus} OPENBLAS_NUM_THREADS={cpus} HOBSON_CPUS={cpus}",
            "export PYTHONUNBUFFERED=1",
        ]
        if job.is_array:
            setup.append("export HOBSON_ARRAY_TASK=$SLURM_ARRAY_TASK_ID")
        setup += list(prof.setup)
        deps = [dep_ids.get(a, f"{{job:{a}}}") for a in job.after]
        log = paths.logs_dir / (f"{job.name}_%a.log" if job.is_array else f"{job.name}.log")
        return render_sbatch(
            "exec " + shlex.join([prof.python, *argv]),
            job_name=f"hobson-{paths.run_dir.name}-{job.name}",
            output=str(log),
            array=array,
            nodes=res.nodes,
            gpus_per_node=res.gpus,
            cpus_per_task=cpus,
            mem=f"{mem_gb}G",
            time=time_limit,
            partition=prof.partition,
            account=prof.account,
            qos=prof.qos,
            constraint=prof.constraint,
            exclusive=prof.exclusive,
            dependency=("afterok:" + ":".join(deps)) if deps else None,
            extra=tuple(prof.extra_sbatch),
            setup=tuple(setup),
        )

    def dry_run(self, jobs: list[JobSpec], paths: RunPaths) -> str:
        parts = []
        for n, job in enumerate(jobs, 1):
            head = f"# ===== job {n}/{len(jobs)}: {job.name} (stage {job.stage})"
            if job.is_array:
                head += f"; array of {len(job.shards)} tasks, task k runs shard k of {job.num_shards}"
            head += "; after: " + (", ".join(job.after) if job.after else "-")
            parts.append(f"{head}\n# sbatch --parsable <script below>\n{self.render(job, paths, {})}")
        return "\n".join(parts)
