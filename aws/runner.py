"""The AWS runner's command line: one EC2 GPU host driven over SSM, running the local backend there.

    python -m aws.runner run --ngpu 8 -- recipe all          # launch or reuse a host, ship, start, follow, fetch
    python -m aws.runner run --dry-run -- recipe all         # print every AWS call and the host command
    python -m aws.runner status RUN | logs RUN [STAGE] | fetch RUN | cancel RUN
    python -m aws.runner infra                               # check/create bucket, role, security group
    python -m aws.runner teardown [--run-id ID]              # terminate only hosts this tool tagged

The work is in :mod:`hobson.aws.remote` (the host) and :mod:`hobson.aws.session` (the run's local
record); the launcher's ``--backend aws`` adapts the same session. Nothing here imports the launcher.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hobson.aws.options import DEFAULT_AWS_CONFIG, AwsConfig
from hobson.aws.remote import Runner
from hobson.aws.session import AwsSession
from hobson.config import load_config
from hobson.errors import HobsonError

# ---------------------------------------------------------------------------------------------
# CLI (the launcher's `--backend aws` adapts the same AwsSession in launch/backends/aws.py)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aws.runner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_AWS_CONFIG, help="AWS config YAML (default configs/aws.yaml)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="run a launch/submit.py argv on one host: `run [opts] -- recipe all`")
    r.add_argument("--ngpu", type=int, default=8, help="GPUs the host must have (default 8)")
    r.add_argument("--run-dir", default=None, help="local run directory (default runs/<new run id>)")
    r.add_argument("--revision", default="HEAD", help="git revision to ship (default HEAD)")
    r.add_argument("--allow-dirty", action="store_true", help="ship working-tree changes (and the diff) too")
    r.add_argument("--detach", action="store_true", help="return once started; follow later with status")
    r.add_argument("--dry-run", action="store_true", help="print every AWS call and the host command; call nothing")
    r.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the launch/submit.py arguments")
    for name, help_ in (("status", "mirror the run record from S3 and show each stage"),
                        ("fetch", "copy records, logs and outputs from S3 into the local run directory"),
                        ("cancel", "stop the run on its host (it records the cancellation)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("run", help="local run directory or id")
    lg = sub.add_parser("logs", help="print a stage's log from S3 (no stage: list them)")
    lg.add_argument("run", help="local run directory or id")
    lg.add_argument("stage", nargs="?", help="job name, e.g. build or teacher-merge (or launcher)")
    lg.add_argument("--task", type=int, default=None, help="array task index")
    sub.add_parser("infra", help="check, and create when missing, the bucket, role and security group")
    t = sub.add_parser("teardown", help="terminate every host this tool tagged (or one run's)")
    t.add_argument("--run-id", default=None, help="only this run's host")
    t.add_argument("--region", action="append", default=None, help="only these regions (default: the config's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, AwsConfig)
        if args.cmd == "infra":
            Runner(cfg).ensure_infra()
            print("[aws] infrastructure in place")
            return 0
        if args.cmd == "teardown":
            for region, ids in Runner(cfg).teardown(args.region, args.run_id).items():
                print(f"[aws] {region}: terminated {', '.join(ids) if ids else 'nothing'}")
            return 0
        return _attached(args) if args.cmd != "run" else _run(args)
    except HobsonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from hobson.records import RunPaths, new_run_id, new_run_json, write_run_json

    run_argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not run_argv:
        raise HobsonError("nothing to run: pass `-- recipe STAGE...` (any launch/submit.py arguments)")
    if run_argv[0] in ("recipe", "rl") and "--ngpu" not in run_argv:
        run_argv = [*run_argv, "--ngpu", str(args.ngpu)]
    paths = RunPaths.create(args.run_dir or Path("runs") / new_run_id())
    backend = AwsSession(args.config, args.ngpu, revision=args.revision, allow_dirty=args.allow_dirty,
                         follow=not args.detach)
    if args.dry_run:
        print(backend.dry_run(run_argv, paths))
        return 0
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    write_run_json(paths, new_run_json(paths, argv=sys.argv, backend="aws", options={"argv": run_argv,
                                       "ngpu": args.ngpu}, config_digests={}))
    return backend.run(run_argv, paths)


def _attached(args: argparse.Namespace) -> int:
    from hobson.records import RunPaths

    paths = RunPaths.attach(args.run)
    backend = AwsSession(args.config) if args.config != DEFAULT_AWS_CONFIG else AwsSession.for_run(paths)
    if args.cmd == "status":
        print(backend.status(paths))
        for line in (paths.stages_jsonl.read_text().splitlines() if paths.stages_jsonl.exists() else []):
            r = json.loads(line)
            print(f"  {r['stage']:<16} {'' if r.get('shard') is None else r['shard']:>4} {r['status']:<9} "
                  f"{r.get('wall_s', 0):>8.1f}s  gpus {r.get('gpus') or 0}  exit {r.get('exit_code')}")
    elif args.cmd == "logs":
        sys.stdout.write(backend.logs(paths, args.stage, args.task))
    elif args.cmd == "fetch":
        print(f"[aws] fetched {len(backend.fetch(paths))} files into {paths.run_dir} and {paths.logs_dir}")
    elif args.cmd == "cancel":
        print(backend.cancel(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())

