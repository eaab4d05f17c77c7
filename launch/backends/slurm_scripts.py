"""The Slurm scripts hobson renders for jobs that are not a recipe stage: the RL job from flags
(what ``python launch/submit.py rl --backend slurm`` submits and ``--dry-run`` prints), and every
shipped ``sbatch/*.sh`` (the RL algorithms' and ``sbatch/recipe.sh``), all through the recipe
jobs' ``render_sbatch``.

:func:`render_rl_sbatch` is a pure function. Its script is the same job as
``sbatch/<algorithm>.sh`` (which :func:`shipped_script` renders, byte for byte): the ``#SBATCH``
blocks of the two components (``#SBATCH hetjob`` between them), the settings as exported
environment variables, then the shared body ``sbatch/rl_common.sh``. ``colocated=True`` renders
one component holding both processes (its GPUs split between them), for clusters that disable
heterogeneous jobs. ``sbatch/recipe.sh`` is one node's allocation running the whole recipe on the
local backend. ``python -m hobson.launch.backends.slurm_scripts --write`` rewrites the shipped files.

The ``python -m jobs.rl`` flags given are mapped onto the script's settings (``--model`` to
MODEL, ``--updates`` to UPDATES, ...); the others travel in RL_ARGS, shell-quoted.
"""

from __future__ import annotations

import inspect
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hobson.launch.sbatch import SbatchBlock, render_sbatch

if TYPE_CHECKING:
    from hobson.launch.options import ClusterProfile

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
    "--transport": "TRANSPORT",
    "--rollout-servers": "ROLLOUT_SERVERS",
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


def _blocks(colocated: bool, train_gpus: int, rollout_gpus: int, train_cpus: int, rollout_cpus: int,
            train_mem: str, rollout_mem: str, rollout_servers: int = 1) -> list[SbatchBlock]:
    if colocated:  # one component holding both processes; its GPUs split between them
        return [SbatchBlock(cpus_per_task=train_cpus + rollout_cpus, mem=train_mem,
                            gpus_per_node=train_gpus + rollout_gpus)]
    train = SbatchBlock(cpus_per_task=train_cpus, mem=train_mem, gpus_per_node=train_gpus)
    if rollout_servers > 1:  # one task per server, its own GPUs, on as many nodes as they need
        return [train, SbatchBlock(cpus_per_task=rollout_cpus, mem=rollout_mem, nodes=None, ntasks=rollout_servers,
                                   gpus_per_task=rollout_gpus)]
    return [train, SbatchBlock(cpus_per_task=rollout_cpus, mem=rollout_mem, gpus_per_node=rollout_gpus)]


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
    """The script text, through the recipe jobs' :func:`render_sbatch`. ``rl_args`` are
    ``python -m jobs.rl`` flags; ``env`` more settings of sbatch/rl_common.sh (THREADS, RESUME,
    ...); ``extra`` verbatim ``--opt=value`` lines for every component (cluster profile); ``setup``
    shell lines run first (module load, venv)."""
    settings, rest = split_rl_args(rl_args)
    settings.setdefault("ALGORITHM", algorithm)
    alg = settings["ALGORITHM"]
    servers = int(settings.get("ROLLOUT_SERVERS", "1"))
    if servers > 1 and colocated:
        raise ValueError(f"--rollout-servers {servers} with --colocated: several servers run as a heterogeneous "
                         "job's rollout component (one GPU each); leave out --colocated")
    if colocated:
        settings.update(COLOCATED="1", ROLLOUT_GPUS=str(rollout_gpus))
    settings.update(env or {})
    settings.setdefault("PYTHON", python)
    settings["HOBSON_LAUNCHED"] = "1"  # the launcher keeps this run's record; the job writes none
    if rest:
        settings["RL_ARGS"] = shlex.join(rest)
    mode = "ONE job, both processes on one node (colocated)" if colocated else (
        "ONE heterogeneous job: component 0 trains, component 1 serves rollouts")
    return render_sbatch(
        'source "$HOBSON_REPO/sbatch/rl_common.sh"',
        preamble=(f"# {alg} as {mode}.",
                  "# Rendered by `submit.py rl --backend slurm` (launch/backends/slurm_scripts.py); the same job",
                  f"# as sbatch/{alg.replace('-', '_')}.sh. Settings: sbatch/rl_common.sh."),
        **_job_wide(job_name or "hobson-" + alg.replace("-", "_"), log, time),
        hetjob=_blocks(colocated, train_gpus, rollout_gpus, train_cpus, rollout_cpus, train_mem, rollout_mem,
                       servers),
        partition=partition, account=account, qos=qos, constraint=constraint, extra=tuple(extra),
        setup=(*setup, f"export HOBSON_REPO=${{HOBSON_REPO:-{shlex.quote(repo)}}}",
               *[f"export {k}={shlex.quote(v)}" for k, v in sorted(settings.items())]),
    )


def _job_wide(job_name: str, log: str, time: str) -> dict[str, Any]:
    # a requeued job appends to the first attempt's log; the script requeues itself on USR2 and resumes
    return {"job_name": job_name, "output": log, "time": time, "open_mode": "append", "signal": "B:USR2@120",
            "requeue": True}


SHIPPED = {"grpo": "grpo", "ppo": "ppo", "dppo": "dppo", "flow_dppo": "flow-dppo"}  # sbatch/<name>.sh -> algorithm


SHIPPED_NAMES = ("recipe", *SHIPPED)  # every sbatch/<name>.sh but rl_common.sh (the RL scripts' shared body)


def recipe_script() -> str:
    """``sbatch/recipe.sh``: the whole decider recipe inside ONE allocation (one node, its GPUs) on
    the local backend; settings from the environment, resources in its ``#SBATCH`` lines."""
    usage = (
        "# Run the whole decider recipe inside ONE Slurm allocation (one node, its GPUs), on the local",
        "# backend: the same stages, records and outputs as `python launch/submit.py recipe ...`, for",
        "# clusters where a single long job is easier to get than a chain of jobs.",
        "#",
        "#   sbatch sbatch/recipe.sh                       # all stages, every GPU of the node",
        '#   STAGES="build multistep teacher" RUN_DIR=runs/mine sbatch sbatch/recipe.sh',
        "#   sbatch --gpus-per-node=1 --cpus-per-task=2 --mem=8G sbatch/recipe.sh   # a smaller node",
        "#",
        "# Settings (environment variables, all optional):",
        "#   STAGES   stages to run (default: all)",
        "#   RUN_DIR  run directory (default: runs/slurm-$SLURM_JOB_ID); reuse one to continue a run",
        "#   CONFIG   recipe config (default: configs/recipe.yaml)",
        "#   NGPU     GPUs to use (default: the GPUs Slurm gave this job, at least 1)",
        "#   PYTHON   interpreter (default: python)",
        "# This file is recipe_script()'s output (launch/backends/slurm_scripts.py; a test keeps them equal).",
    )
    setup = (
        "set -euo pipefail",
        'cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"',
        "STAGES=${STAGES:-all}",
        "RUN_DIR=${RUN_DIR:-runs/slurm-${SLURM_JOB_ID:-local}}",
        "CONFIG=${CONFIG:-configs/recipe.yaml}",
        "PYTHON=${PYTHON:-python}",
        'if [ -z "${NGPU:-}" ]; then',
        '  NGPU=$(echo "${CUDA_VISIBLE_DEVICES:-0}" | tr \',\' \'\\n\' | grep -c . || true)',
        '  [ "$NGPU" -ge 1 ] || NGPU=1',
        "fi",
    )
    return render_sbatch(
        "# shellcheck disable=SC2086  # STAGES is a list of words\n"
        'exec "$PYTHON" launch/submit.py recipe $STAGES --backend local --ngpu "$NGPU" --run-dir "$RUN_DIR" '
        '--config "$CONFIG"',
        job_name="hobson-recipe", output="logs/recipe-%j.log", time="04:00:00", nodes=1, gpus_per_node=8,
        cpus_per_task=16, mem="128G", preamble=usage, setup=setup,
    )


def shipped_script(name: str) -> str:
    """``sbatch/<name>.sh`` exactly. For an algorithm: the job ``render_rl_sbatch`` renders at its
    defaults, as a plain script a Slurm user submits with ``sbatch`` and edits (settings from the
    environment, the checkout from ``$SLURM_SUBMIT_DIR``); ``recipe``: :func:`recipe_script`.
    ``python -m hobson.launch.backends.slurm_scripts --write`` rewrites them."""
    if name == "recipe":
        return recipe_script()
    alg = SHIPPED[name]
    usage = (
        f"# {alg} on a looped model (Huginn, Nanbeige) as ONE heterogeneous Slurm job: component 0 trains",
        "# (python -m jobs.rl), component 1 serves rollouts (python -m jobs.rollout_server); weights",
        "# reach the server as versioned publications in OUTPUT/publications/.",
        "#",
        f"#   sbatch sbatch/{name}.sh                                     # tiny Huginn + arithmetic data",
        f"#   MODEL=/models/huginn-0125 DATA=math.jsonl OUTPUT=runs/huginn-{name} UPDATES=100 sbatch sbatch/{name}.sh",
        f"#   OUTPUT=runs/huginn-{name} sbatch sbatch/{name}.sh              # a second job on OUTPUT resumes it",
        f"#   DEVICE=cpu THREADS=1 sbatch sbatch/{name}.sh                # CPU nodes",
        "#",
        "# Settings (environment variables, all optional; details in sbatch/rl_common.sh):",
        "#   MODEL DATA OUTPUT UPDATES STOP_AFTER RESUME DEVICE ENGINE_DEVICE MODEL_REVISION ENGINE_REVISION",
        "#   THREADS RL_ARGS READY_TIMEOUT REQUEST_TIMEOUT PUBLISH_TIMEOUT TRANSPORT ROLLOUT_SERVERS",
        "#   HOBSON_REPO PYTHON",
        f"#   ALGORITHM (default {alg})",
        "# Resources: component 0 is the first block of #SBATCH lines, component 1 the block after",
        '# "#SBATCH hetjob"; change them here or on the sbatch command line (which sets component 0\'s).',
        "# This file is render_rl_sbatch's job at its defaults (launch/backends/slurm_scripts.py; tested equal).",
    )
    d = inspect.signature(render_rl_sbatch).parameters
    return render_sbatch(
        'source "${HOBSON_REPO:-${SLURM_SUBMIT_DIR:-.}}/sbatch/rl_common.sh"',
        preamble=usage,
        **_job_wide(f"hobson-{name}", f"logs/rl-{name}-%j.log", d["time"].default),
        hetjob=_blocks(False, *(d[k].default for k in ("train_gpus", "rollout_gpus", "train_cpus", "rollout_cpus",
                                                       "train_mem", "rollout_mem"))),
        setup=(f"ALGORITHM=${{ALGORITHM:-{alg}}}", "# shellcheck source=sbatch/rl_common.sh"),
    )


def script_for_profile(rl_args: Sequence[str], profile: ClusterProfile, log: str, **options: Any) -> str:
    """``render_rl_sbatch`` with the cluster profile's partition, account, extra lines and setup;
    ``options`` are render_rl_sbatch's (colocated, train_gpus, rollout_gpus, ...)."""
    from hobson.records import REPO_ROOT

    return render_rl_sbatch(
        rl_args, repo=str(REPO_ROOT), log=log, partition=profile.partition, account=profile.account,
        qos=profile.qos, constraint=profile.constraint, extra=profile.extra_sbatch, setup=profile.setup,
        python=profile.python, **options,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m hobson.launch.backends.slurm_scripts [--write]``: print (or rewrite) the shipped sbatch/*.sh."""
    import argparse

    from hobson.records import REPO_ROOT

    p = argparse.ArgumentParser(prog="python -m hobson.launch.backends.slurm_scripts", description=main.__doc__)
    p.add_argument("--write", action="store_true", help="rewrite sbatch/*.sh from the renderer")
    args = p.parse_args(argv)
    for name in SHIPPED_NAMES:
        text = shipped_script(name)
        if args.write:
            (REPO_ROOT / "sbatch" / f"{name}.sh").write_text(text)
        else:
            print(f"===== sbatch/{name}.sh\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
