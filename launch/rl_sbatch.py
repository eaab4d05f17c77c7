"""The RL job's sbatch script from flags: what ``python launch/submit.py rl --backend slurm``
submits (and ``--dry-run`` prints).

:func:`render_rl_sbatch` is a pure function. Its script is the same job as
``sbatch/<algorithm>.sh``: the ``#SBATCH`` blocks of the two components (``#SBATCH hetjob``
between them), the settings as exported environment variables, then the shared body
``sbatch/rl_common.sh``. ``colocated=True`` renders one component holding both processes (its
GPUs split between them), for clusters that disable heterogeneous jobs.

The ``python -m jobs.rl`` flags given are mapped onto the script's settings (``--model`` to
MODEL, ``--updates`` to UPDATES, ...); the others travel in RL_ARGS, shell-quoted.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hobson.launch.sbatch import _quote

if TYPE_CHECKING:
    from hobson.launch.options import ClusterProfile
    from hobson.records import RunPaths

# jobs.rl flag -> the script's variable (the flags rl_common.sh sets itself)
FLAG_VARS = {
    "--algorithm": "ALGORITHM",
    "--model": "MODEL",
    "--data": "DATA",
    "--output": "OUTPUT",
    "--updates": "UPDATES",
    "--stop-after": "STOP_AFTER",
    "--device": "DEVICE",
    "--engine-device": "ENGINE_DEVICE",
    "--model-revision": "MODEL_REVISION",
    "--engine-revision": "ENGINE_REVISION",
    "--engine-timeout": "REQUEST_TIMEOUT",
    "--publish-timeout": "PUBLISH_TIMEOUT",
    "--engine-ready-timeout": "READY_TIMEOUT",
}


def split_rl_args(rl_args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``(settings, remaining flags)`` of a ``python -m jobs.rl`` command line."""
    env: dict[str, str] = {}
    rest: list[str] = []
    args = list(rl_args)
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in FLAG_VARS:
            if not eq:
                if i + 1 >= len(args):
                    raise ValueError(f"{a} needs a value")
                value = args[i + 1]
                i += 1
            env[FLAG_VARS[name]] = value
        elif a == "--resume":
            env["RESUME"] = "1"
        else:
            rest.append(a)
        i += 1
    return env, rest


def _component(gpus: int, cpus: int, mem: str) -> list[str]:
    lines = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}", f"--mem={_quote(mem)}"]
    if gpus:
        lines.append(f"--gpus-per-node={gpus}")
    return [f"#SBATCH {x}" for x in lines]


def render_rl_sbatch(
    rl_args: Sequence[str],
    *,
    repo: str,
    log: str,
    algorithm: str = "grpo",
    job_name: str | None = None,
    time: str = "24:00:00",
    colocated: bool = False,
    train_gpus: int = 1,
    rollout_gpus: int = 1,
    train_cpus: int = 8,
    rollout_cpus: int = 8,
    train_mem: str = "40G",
    rollout_mem: str = "40G",
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    constraint: str | None = None,
    extra: Sequence[str] = (),
    setup: Sequence[str] = (),
    python: str = "python",
    env: dict[str, str] | None = None,
) -> str:
    """The script text. ``rl_args`` are ``python -m jobs.rl`` flags; ``env`` more settings of
    sbatch/rl_common.sh (THREADS, RESUME, ...); ``extra`` verbatim ``--opt=value`` lines for
    every component (cluster profile); ``setup`` shell lines run first (module load, venv)."""
    settings, rest = split_rl_args(rl_args)
    settings.setdefault("ALGORITHM", algorithm)
    alg = settings["ALGORITHM"]
    shared = [f"--{k}={_quote(v)}" for k, v in (("partition", partition), ("account", account), ("qos", qos),
                                                 ("constraint", constraint)) if v]
    shared += list(extra)
    head = [
        f"#SBATCH --job-name={_quote(job_name or 'hobson-' + alg.replace('-', '_'))}",
        f"#SBATCH --output={_quote(log)}",
        f"#SBATCH --time={_quote(time)}",
        "#SBATCH --open-mode=append",  # a requeued job appends to the first attempt's log
        "#SBATCH --signal=B:USR2@120",  # the script requeues itself on USR2 and resumes
        "#SBATCH --requeue",
        *[f"#SBATCH {x}" for x in sorted(shared)],
    ]
    if colocated:
        blocks = [*head, *_component(train_gpus + rollout_gpus, train_cpus + rollout_cpus, train_mem)]
        settings.update(COLOCATED="1", ROLLOUT_GPUS=str(rollout_gpus))
    else:
        blocks = [
            *head,
            *_component(train_gpus, train_cpus, train_mem),
            "#SBATCH hetjob",
            *[f"#SBATCH {x}" for x in sorted(shared)],
            *_component(rollout_gpus, rollout_cpus, rollout_mem),
        ]
    settings.update(env or {})
    settings.setdefault("PYTHON", python)
    if rest:
        settings["RL_ARGS"] = shlex.join(rest)
    mode = "ONE job, both processes on one node (colocated)" if colocated else (
        "ONE heterogeneous job: component 0 trains, component 1 serves rollouts")
    return "\n".join([
        "#!/bin/bash",
        f"# {alg} as {mode}.",
        "# Rendered by `python launch/submit.py rl --backend slurm` (launch/rl_sbatch.py); the same job",
        f"# as sbatch/{alg.replace('-', '_')}.sh. Settings: sbatch/rl_common.sh.",
        *blocks,
        "",
        *setup,
        f"export HOBSON_REPO=${{HOBSON_REPO:-{shlex.quote(repo)}}}",
        *[f"export {k}={shlex.quote(v)}" for k, v in sorted(settings.items())],
        'source "$HOBSON_REPO/sbatch/rl_common.sh"',
        "",
    ])


def script_for_profile(rl_args: Sequence[str], profile: ClusterProfile, log: str, **options: Any) -> str:
    """``render_rl_sbatch`` with the cluster profile's partition, account, extra lines and setup;
    ``options`` are render_rl_sbatch's (colocated, train_gpus, rollout_gpus, ...)."""
    from hobson.records import REPO_ROOT

    return render_rl_sbatch(
        rl_args, repo=str(REPO_ROOT), log=log, partition=profile.partition, account=profile.account,
        qos=profile.qos, constraint=profile.constraint, extra=profile.extra_sbatch, setup=profile.setup,
        python=profile.python, **options,
    )


def submit_script(script: str, paths: RunPaths) -> str:
    """Submit ``script`` the way the Slurm backend submits every job, record the submission in the
    run record, and return the job id (for scripts rendered outside a launch, e.g. in tests)."""
    from hobson.errors import HobsonError
    from hobson.launch.backends.slurm import sbatch
    from hobson.records import read_run_json, utc_now, write_run_json

    (paths.run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    paths.logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        sj = sbatch(script, paths.run_dir / "slurm")
    except Exception as e:  # submitit raises its own types; quote sbatch's answer
        raise HobsonError(f"sbatch refused the rl job: {e}") from None
    meta = read_run_json(paths)
    meta.setdefault("submissions", []).append(
        {"job": "rl", "backend": "slurm", "job_id": sj.job_id, "attempt": utc_now(),
         "script": str(sj.paths.submission_file)})
    write_run_json(paths, meta)
    return str(sj.job_id)
