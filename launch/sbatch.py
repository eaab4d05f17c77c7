"""sbatch scripts from one pure function.

:func:`render_sbatch` takes every option as a defaulted keyword; the valid options are read
from its signature (:data:`VALID_OPTIONS`), so there is one source of truth. The output is a
shebang, an optional comment preamble, a ``# Parameters`` block of sorted ``#SBATCH --key=value``
lines, then ``# setup``, ``# command`` and ``# teardown`` sections. The dry-run prints exactly
what the Slurm backend submits. A job of several components (the RL run: training, rollout) is
one heterogeneous job: ``hetjob`` gives each component's resources, and each block after the first
starts with ``#SBATCH hetjob``. Recipe stages, the RL job and the shipped ``sbatch/*.sh`` are all
rendered here.
"""

from __future__ import annotations

import inspect
import shlex
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SbatchBlock:
    """One component's resources in a heterogeneous job: ``ntasks`` tasks on ``nodes`` nodes
    (``None``: as many as Slurm needs to place them), GPUs per node or per task."""

    cpus_per_task: int = 1
    mem: str | None = None
    gpus_per_node: int = 0
    nodes: int | None = 1
    ntasks: int = 1
    gpus_per_task: int = 0

    def lines(self) -> list[str]:
        opts = {"nodes": str(self.nodes) if self.nodes is not None else None, "ntasks": str(self.ntasks),
                "cpus-per-task": str(self.cpus_per_task), "mem": self.mem,
                "gpus-per-node": str(self.gpus_per_node) if self.gpus_per_node else None,
                "gpus-per-task": str(self.gpus_per_task) if self.gpus_per_task else None}
        return [f"#SBATCH --{k}={_quote(v)}" for k, v in opts.items() if v is not None]


def render_sbatch(
    command: str,
    *,
    job_name: str,
    output: str,
    error: str | None = None,
    array: str | None = None,
    nodes: int = 1,
    ntasks_per_node: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int = 1,
    mem: str | None = None,
    time: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    constraint: str | None = None,
    exclusive: bool = False,
    dependency: str | None = None,
    kill_on_invalid_dep: bool = True,
    signal: str | None = None,
    requeue: bool = False,
    open_mode: str = "append",
    extra: tuple[str, ...] = (),
    setup: tuple[str, ...] = (),
    teardown: tuple[str, ...] = (),
    hetjob: Sequence[SbatchBlock] = (),
    preamble: tuple[str, ...] = (),
) -> str:
    """Render one sbatch script. ``extra`` holds verbatim ``--opt=value`` lines (cluster profile).

    ``hetjob`` (two or more blocks) makes a heterogeneous job: its blocks replace ``nodes``,
    ``ntasks_per_node``, ``gpus_per_node``, ``cpus_per_task`` and ``mem``; partition, account, qos,
    constraint, exclusive and ``extra`` repeat in every block (Slurm reads them per component).
    ``preamble`` lines (comments) follow the shebang."""
    job_wide: dict[str, str | None] = {
        "job-name": job_name,
        "output": output,
        "error": error if error != output else None,
        "array": array,
        "time": time,
        "dependency": dependency,
        "kill-on-invalid-dep": "yes" if (dependency and kill_on_invalid_dep) else None,
        "signal": signal,
        "open-mode": open_mode,
    }
    shared: dict[str, str | None] = {"partition": partition, "account": account, "qos": qos, "constraint": constraint}
    lines = _opts(job_wide) + _opts(shared) + (["#SBATCH --requeue"] if requeue else [])
    per_block = (["#SBATCH --exclusive"] if exclusive else []) + [f"#SBATCH {e}" for e in extra]
    if hetjob:
        blocks = [sorted(lines + per_block + hetjob[0].lines())]
        blocks += [["#SBATCH hetjob", *sorted(_opts(shared) + per_block + b.lines())] for b in hetjob[1:]]
        directives = [line for block in blocks for line in block]
    else:
        lines += _opts({"nodes": str(nodes), "ntasks-per-node": str(ntasks_per_node),
                        "cpus-per-task": str(cpus_per_task),
                        "gpus-per-node": str(gpus_per_node) if gpus_per_node else None, "mem": mem})
        directives = sorted(lines + per_block)
    return "\n".join([
        "#!/bin/bash",
        *preamble,
        "",
        "# Parameters",
        *directives,
        "",
        "# setup",
        *setup,
        "",
        "# command",
        command,
        "",
        "# teardown",
        *teardown,
        "",
    ])


def _opts(opts: dict[str, str | None]) -> list[str]:
    return [f"#SBATCH --{k}={_quote(v)}" for k, v in opts.items() if v is not None]


def _quote(v: str) -> str:
    # '%' and ':' are sbatch syntax here, not shell; quote only what the shell would split.
    return v if all(c.isalnum() or c in "%:/._-,=@[]+{}" for c in v) else shlex.quote(v)


VALID_OPTIONS: dict[str, object] = {
    name: p.default for name, p in inspect.signature(render_sbatch).parameters.items()
    if name not in ("command", "hetjob", "preamble")
}
