"""Run one stage (or one array task) and record it: ``python -m hobson.stagerun``.

Every backend runs a stage through this wrapper, so the record is the same whoever ran it:
start/end UTC, wall seconds, GPUs, exit code, and for each declared output its row count,
expected rows (OK/FAIL) and sha256. The stage's own code never sees the record or the
backend: it is ``hobson.jobs.<job>.main(argv)`` (the checkout's ``jobs/<job>.py``).

    python -m hobson.stagerun --run-dir R --stage teacher --job teacher \\
        --shards 0-7 --output labels/teacher.shard{shard}of8.jsonl -- --corpus ... --shard {shard}
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from hobson.io import count_lines, sha256_file
from hobson.records import RunPaths, append_stage_record, utc_now
from hobson.shards import parse_spec, task_shard


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        own, job_args = argv[:i], argv[i + 1 :]
    else:
        own, job_args = argv, []
    p = argparse.ArgumentParser(prog="python -m hobson.stagerun", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory (holds stages.jsonl)")
    p.add_argument("--stage", required=True, help="stage name as the DAG names it")
    p.add_argument("--job", required=True, help="entry point: runs hobson.jobs.<JOB>.main(job args)")
    p.add_argument("--shards", default=None,
                   help="array stages: the shard list; task k (HOBSON_ARRAY_TASK) runs shards[k]")
    p.add_argument("--gpus", type=int, default=0, help="GPUs this task holds (recorded)")
    p.add_argument("--cpus", type=int, default=None, help="torch threads (recorded)")
    p.add_argument("--output", action="append", default=[],
                   help="REL[=ROWS]: an output relative to the run dir, with the row count expected")
    p.add_argument("--torchrun", type=int, default=None, metavar="NPROC",
                   help="run the stage under torchrun with NPROC ranks on this node, forwarding SIGUSR2 to the "
                        "ranks (torchrun itself dies on USR2); rank 0 records the stage")
    return p.parse_args(own), job_args


PREEMPTED = 75  # a training stage checkpointed after SIGUSR2 and wants its job requeued


class _Terminated(BaseException):
    """SIGTERM (scancel, a time limit) as an exception: the stage's temporary files are removed on
    the way out and the record says what happened. A BaseException, so a stage's ``except
    Exception`` cannot swallow it."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (no psutil on compute nodes)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _run_torchrun(argv: list[str], nproc: int) -> int:
    """Agent: torchrun over this node's ranks; USR2 goes to the ranks, which checkpoint and exit 75.

    On Slurm the rendezvous is c10d on the first host of the allocation (``HOBSON_RDZV``); alone,
    ``--standalone``. Every node's agent runs the same command.
    """
    import subprocess

    i = argv.index("--torchrun")
    inner = argv[:i] + argv[i + 2:]
    if os.environ.get("HOBSON_RDZV"):
        rdzv = [f"--nnodes={os.environ.get('SLURM_NNODES', '1')}", "--rdzv_backend=c10d",
                f"--rdzv_id={os.environ.get('SLURM_JOB_ID', 'hobson')}", f"--rdzv_endpoint={os.environ['HOBSON_RDZV']}"]
    else:
        rdzv = ["--standalone"]
    from hobson.lifetime import die_with_parent

    # torchrun (and with it the ranks it stops on SIGTERM) ends with this agent
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc_per_node={nproc}",
                             "-m", "hobson.stagerun", *inner], preexec_fn=die_with_parent(new_session=False))
    preempted = False

    def forward(signum, frame) -> None:
        nonlocal preempted
        preempted = True
        for child in _children(proc.pid):
            try:
                os.kill(child, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        print(f"[hobson] SIGUSR2: forwarded to the ranks of torchrun pid {proc.pid}", flush=True)

    signal.signal(signal.SIGUSR2, forward)
    code = proc.wait()
    # torchrun reports a rank's exit 75 as its own failure: the agent knows it was a preemption
    return PREEMPTED if preempted and code != 0 else code


def _describe_output(paths: RunPaths, spec: str) -> dict:
    rel, _, expected = spec.partition("=")
    path = paths.abs(rel)
    entry: dict = {"path": rel, "expected_rows": int(expected) if expected else None}
    if not path.exists():
        entry.update(rows=None, sha256=None, ok=False, error="missing")
        return entry
    rows = count_lines(path) if path.suffix == ".jsonl" else None
    entry.update(rows=rows, sha256=sha256_file(path))
    entry["ok"] = entry["expected_rows"] is None or rows == entry["expected_rows"]
    return entry


def _injected_fault(stage: str, shard: int | None) -> None:
    """TEST-ONLY fault injection: ``HOBSON_TEST_FAIL=stage[:shard],...`` fails those tasks.

    The Slurm tests use it to make one array task fail and then check that retry resubmits
    only that task. It fails before any output is written, exactly like a crashed stage.
    """
    for item in filter(None, os.environ.get("HOBSON_TEST_FAIL", "").split(",")):
        name, _, which = item.partition(":")
        if name == stage and (not which or (shard is not None and int(which) == shard)):
            print(f"[hobson] HOBSON_TEST_FAIL: injected failure of {item}", file=sys.stderr, flush=True)
            raise SystemExit(42)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, job_args = _parse(argv)
    # Triton keeps its compiled kernels between processes (~/.triton/cache) but, unless told, not
    # its autotuning choices: each process of each stage (every DDP rank, every array task) then
    # benchmarks fla's kernels again, minutes for the decider's torso. Kept in the same cache, the
    # first process's choices serve the rest; on a fresh H100 the carried cache cut the training
    # warm-up from 192 s to 48 s (docs/BENCHMARKS.md, session 22). A user's own setting wins.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if args.torchrun:
        return _run_torchrun(argv, args.torchrun)
    run_dir = Path(args.run_dir).resolve()
    paths = RunPaths(run_dir, run_dir)  # the wrapper writes only the record; logs are the backend's
    shard = task_shard(parse_spec(args.shards), None) if args.shards else None
    task = int(os.environ["HOBSON_ARRAY_TASK"]) if args.shards and "HOBSON_ARRAY_TASK" in os.environ else None
    # The job sees the same (possibly narrowed, on retry) shard list as this wrapper.
    subst = ((lambda s: s.replace("{shards}", args.shards).replace("{shard}", str(shard)))
             if shard is not None else (lambda s: s))
    job_args = [subst(a) for a in job_args]
    outputs = [subst(o) for o in args.output]
    if args.cpus:
        from hobson.threads import set_threads_before_torch  # before the stage builds anything: results match

        set_threads_before_torch(args.cpus)

    from hobson import faults

    faults.hold(f"stage-{args.stage}")  # (fault tests: a stage held before it starts, e.g. to race a launcher)
    start, t0 = utc_now(), time.monotonic()
    print(f"[hobson] stage {args.stage}" + (f" shard {shard} (task {task})" if shard is not None else "")
          + f" on {os.environ.get('SLURMD_NODENAME') or socket.gethostname()} at {start}", flush=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # under torchrun: which rank runs where, and how it meets the others (a multi-node job's
        # log holds one such line per rank; the multi-node test reads them)
        net = " ".join(f"{k}={os.environ[k]}" for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ)
        # one write (print() writes the newline apart): the other ranks write to the same log
        env = os.environ
        line = (f"[hobson] rank {env['RANK']} of WORLD_SIZE={env['WORLD_SIZE']}"
                f" (local rank {env.get('LOCAL_RANK', '?')}) on SLURMD_NODENAME={env.get('SLURMD_NODENAME', '-')},"
                f" rendezvous {env.get('HOBSON_RDZV', 'standalone')}")
        sys.stdout.write(line + (f", {net}" if net else "") + "\n")
        sys.stdout.flush()
    error = None
    # (signal handlers can only be set from the main thread; a stage run from another keeps Python's)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        _injected_fault(args.stage, shard)
        # A dotted name is a module path (tests run their own small jobs); else hobson.jobs.<job>.
        module = importlib.import_module(args.job if "." in args.job else f"hobson.jobs.{args.job}")
        code = module.main(job_args) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code not in (None, 0) and not isinstance(e.code, int):
            error = str(e.code)
            print(f"error: {e.code}", file=sys.stderr)
    except KeyboardInterrupt:
        code, error = 130, "interrupted"
    except _Terminated:
        code, error = 128 + signal.SIGTERM, "terminated by SIGTERM"
        print("[hobson] SIGTERM: stage stopped", file=sys.stderr, flush=True)
    except Exception as e:  # the record must say why; the traceback goes to the log
        from hobson.errors import HobsonError

        code, error = 1, f"{type(e).__name__}: {e}"
        if isinstance(e, HobsonError):
            print(f"error: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    wall = time.monotonic() - t0
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 hashes outputs and records the stage
        return code
    record = {
        "stage": args.stage, "shard": shard, "task": task,
        "start_utc": start, "end_utc": utc_now(), "wall_s": round(wall, 3),
        "gpus": args.gpus, "cpus": args.cpus, "exit_code": code,
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "job_id": os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID"), "pid": os.getpid(),
    }
    if code == 0:
        record["outputs"] = [_describe_output(paths, o) for o in outputs]
        bad = [o for o in record["outputs"] if not o["ok"]]
        for o in record["outputs"]:
            rows = "" if o["rows"] is None else f" {o['rows']} rows"
            exp = "" if o["expected_rows"] is None else f" (expected {o['expected_rows']})"
            print(f"[hobson]   {'OK  ' if o['ok'] else 'FAIL'} {o['path']}{rows}{exp}", flush=True)
        if bad:
            code = record["exit_code"] = 3
            error = "; ".join(f"{o['path']}: {o.get('error') or 'rows ' + str(o['rows'])}" for o in bad)
    if error:
        record["error"] = error[-2000:]
    record["status"] = "ok" if code == 0 else ("preempted" if code == PREEMPTED else "failed")
    record["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    append_stage_record(paths, record)
    print(f"[hobson] stage {args.stage} {record['status']} (exit {code}) in {wall:.1f}s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
