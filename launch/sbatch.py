"""sbatch scripts from one pure function.

:func:`render_sbatch` takes every option as a defaulted keyword; the valid options are read
from its signature (:data:`VALID_OPTIONS`), so there is one source of truth. The output is a
shebang, a ``# Parameters`` block of sorted ``#SBATCH --key=value`` lines, then ``# setup``,
``# command`` and ``# teardown`` sections. The dry-run prints exactly what the Slurm backend
submits.
"""

from __future__ import annotations

import inspect
import shlex


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
) -> str:
    """Render one sbatch script. ``extra`` holds verbatim ``--opt=value`` lines (cluster profile)."""
    params: dict[str, str | None] = {
        "job-name": job_name,
        "output": output,
        "error": error if error != output else None,
        "array": array,
        "nodes": str(nodes),
        "ntasks-per-node": str(ntasks_per_node),
        "cpus-per-task": str(cpus_per_task),
        "gpus-per-node": str(gpus_per_node) if gpus_per_node else None,
        "mem": mem,
        "time": time,
        "partition": partition,
        "account": account,
        "qos": qos,
        "constraint": constraint,
        "dependency": dependency,
        "kill-on-invalid-dep": "yes" if (dependency and kill_on_invalid_dep) else None,
        "signal": signal,
        "open-mode": open_mode,
    }
    lines = [f"#SBATCH --{k}={_quote(v)}" for k, v in sorted(params.items()) if v is not None]
    if exclusive:
        lines.append("#SBATCH --exclusive")
    if requeue:
        lines.append("#SBATCH --requeue")
    lines += [f"#SBATCH {e}" for e in sorted(extra)]
    lines.sort()
    return "\n".join([
        "#!/bin/bash",
        "",
        "# Parameters",
        *lines,
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


def _quote(v: str) -> str:
    # '%' and ':' are sbatch syntax here, not shell; quote only what the shell would split.
    return v if all(c.isalnum() or c in "%:/._-,=@[]+{}" for c in v) else shlex.quote(v)


VALID_OPTIONS: dict[str, object] = {
    name: p.default for name, p in inspect.signature(render_sbatch).parameters.items() if name != "command"
}
