"""The run record of an RL job started with plain ``sbatch sbatch/<alg>.sh``, written from inside it.

    python -m hobson.launch.sbatch_record --run-dir D --job-id ID [--colocated] [--log L] -- RL FLAGS

sbatch/rl_common.sh calls this when the launcher did not submit the job (``HOBSON_LAUNCHED``
unset), so ``python launch/submit.py status D`` (both components, ``rl training`` +0 and
``rl rollout`` +1), ``logs D rl``, ``cancel D`` and ``retry D`` work on it as on a launched run.
The record is the launcher's own: ``new_run_json`` with the Slurm backend's options, the RL
flags as ``options.rl`` (what ``retry`` renders again) and one submission naming the job, its
components, its script and its log. A requeued job (same id) runs the script again: its
submission is already there and is not added twice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hobson.launch import backends
from hobson.launch.backends.base import BackendOptions
from hobson.launch.dag import RL_ROLLOUT, RL_TRAINING
from hobson.records import RunPaths, new_run_json, read_run_json, utc_now, write_run_json


def job_facts(job_id: str, colocated: bool) -> tuple[dict[str, dict], str | None, str | None]:
    """``(resources per component, log, script)`` of a running job, from ``scontrol show job -o``
    (one line per component; the colocated job's one component is split between both processes,
    as the renderer sums them)."""
    from hobson.launch.backends.base import scrubbed_environ
    from hobson.launch.backends.slurm import _client

    out = _client(["scontrol", "show", "job", "-o", job_id], scrubbed_environ())
    comps = []
    for line in (out.stdout if out is not None and out.returncode == 0 else "").splitlines():
        kv = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        comps.append(kv)
    if not comps:
        return {}, None, None
    res = [_resources(kv) for kv in comps]
    if colocated or len(res) == 1:
        r = res[0]
        serve = {**r, "cpus": max(r["cpus"] // 2, 1), "gpus": r["gpus"] // 2}
        res = [{**r, "cpus": max(r["cpus"] - serve["cpus"], 1), "gpus": r["gpus"] - serve["gpus"]}, serve]
    return dict(zip((RL_TRAINING, RL_ROLLOUT), res[:2], strict=True)), comps[0].get("StdOut"), comps[0].get("Command")


def _resources(kv: dict[str, str]) -> dict:
    mem = kv.get("MinMemoryNode") or "40G"
    scale = {"K": 1 / 1024 / 1024, "M": 1 / 1024, "G": 1, "T": 1024}.get(mem[-1:], 1 / 1024)
    mem_gb = max(int(-(-float(mem.rstrip("KMGT")) * scale // 1)), 1)
    gpus = kv.get("TresPerNode", "")  # gres:gpu:N (22.05) or gres/gpu:N
    n_gpu = int(gpus.rsplit(":", 1)[-1]) if "gpu" in gpus and gpus.rsplit(":", 1)[-1].isdigit() else 0
    return {"cpus": int(kv.get("NumCPUs", "8")), "mem_gb": mem_gb, "gpus": n_gpu,
            "time": kv.get("TimeLimit", "24:00:00")}


def record(run_dir: Path, job_id: str, rl_args: list[str], *, colocated: bool, log: str | None = None,
           script: str | None = None, resources: dict[str, dict] | None = None, ngpu: int = 1) -> RunPaths:
    """Write (or complete) ``run_dir/run.json`` for Slurm job ``job_id``; returns the run's paths.
    ``resources`` (per component) are what a retry asks for again."""
    logs_dir = Path(log).resolve().parent if log else None
    paths = RunPaths.create(run_dir, logs_dir.parent if logs_dir else None)
    if logs_dir:
        paths = RunPaths(paths.run_dir, logs_dir)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    if paths.run_json.exists():
        meta = read_run_json(paths)
    else:
        options = {"rl": rl_args, "outputs": [], "ngpu": ngpu, "rollout_gpus": 1, "colocated": colocated,
                   "resources": resources or None, "started_by": "sbatch"}
        backend = backends.create("slurm", BackendOptions(ngpu=ngpu))
        meta = backends.record(new_run_json(paths, argv=["sbatch", script or "sbatch/<alg>.sh"], backend="slurm",
                                            options=options, config_digests={}), backend)
    if not any(s.get("job_id") == job_id for s in meta.get("submissions", [])):
        sub = {"job": "rl", "backend": "slurm", "job_id": job_id, "attempt": utc_now(),
               "components": [RL_TRAINING, RL_ROLLOUT], "colocated": colocated, "script": script}
        if log:
            sub["log"] = str(Path(log).resolve())
        meta.setdefault("submissions", []).append(sub)
    write_run_json(paths, meta)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hobson.launch.sbatch_record", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path, help="the run directory to record into")
    p.add_argument("--job-id", required=True, help="the Slurm job id ($SLURM_JOB_ID)")
    p.add_argument("--colocated", action="store_true", help="one component holding both processes")
    p.add_argument("rl", nargs=argparse.REMAINDER, help="-- then the python -m jobs.rl flags of the run")
    args = p.parse_args(argv)
    rl_args = args.rl[1:] if args.rl[:1] == ["--"] else args.rl
    resources, log, script = job_facts(args.job_id, args.colocated)
    paths = record(args.run_dir, args.job_id, rl_args, colocated=args.colocated, log=log, script=script,
                   resources=resources)
    print(f"hobson-rl: run record {paths.run_dir} (python launch/submit.py status {paths.run_dir})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
