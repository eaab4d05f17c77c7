#!/usr/bin/env python
"""hobson's launcher: run the decider recipe's stages on the local machine, Slurm or one AWS host.

    python launch/submit.py recipe build multistep teacher --ngpu 4
    python launch/submit.py recipe all --dry-run --backend slurm --ngpu 8
    python launch/submit.py status <run>        # also: logs, cancel, retry, verify

A run is a directory (runs/<run-id>/ by default) holding run.json and stages.jsonl; every
command after `recipe` re-attaches to a run from those files alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hobson.config import config_digest, load_config
from hobson.errors import HobsonError, internal_error
from hobson.io import sha256_file
from hobson.launch import backends, dag, status
from hobson.launch.backends.base import Backend, BackendOptions, Launch, job_progress, recorded_absence
from hobson.launch.lock import launcher_lock, refuse_if_jobs_active
from hobson.launch.options import DEFAULT_CLUSTER, DEFAULT_RECIPE, ClusterProfile, RecipeConfig
from hobson.records import (
    REPO_ROOT,
    RunPaths,
    new_run_id,
    new_run_json,
    read_run_json,
    read_stage_records,
    write_run_json,
)

BACKENDS = backends.NAMES


# ---------------------------------------------------------------------------------------------
# recipe


def _expected_rows(cfg: RecipeConfig):
    """Row counts the embedded default corpus is known to have (None where not known)."""
    default = cfg.corpus.scale == 1.0 and cfg.corpus.seed == 0
    try:
        from hobson.corpus import EXPECTED_ROWS
    except ImportError:
        EXPECTED_ROWS = {}

    def rows(rel: str) -> int | None:
        return EXPECTED_ROWS.get(rel.removeprefix("data/")) if default else None

    return rows


def _load_recipe(args: argparse.Namespace) -> tuple[RecipeConfig, ClusterProfile, dict[str, str]]:
    cfg = load_config(args.config, RecipeConfig)
    if args.scale is not None:
        cfg.corpus.scale = args.scale
    if args.seed is not None:
        cfg.corpus.seed = args.seed
    if args.teacher is not None:
        cfg.teacher.model = str(Path(args.teacher).resolve())
    for flag, key in (("train_config", "train_config"), ("parent_config", "parent_config"), ("ckpt", "init_from"),
                      ("torso", "torso")):
        if getattr(args, flag, None) is not None:
            setattr(cfg.decider, key, str(Path(getattr(args, flag)).resolve()))
    if getattr(args, "seeds", None):
        cfg.decider.seeds = args.seeds
    prof = load_config(args.cluster, ClusterProfile)
    if args.partition:
        prof.partition = args.partition
    if args.account:
        prof.account = args.account
    digests = {str(args.config): config_digest(args.config), str(args.cluster): config_digest(args.cluster)}
    return cfg, prof, digests


def _backend_options(args: argparse.Namespace) -> BackendOptions:
    return BackendOptions(ngpu=args.ngpu, cluster=str(args.cluster), partition=args.partition, account=args.account,
                          aws_config=str(args.aws_config) if getattr(args, "aws_config", None) else None,
                          allow_dirty=getattr(args, "allow_dirty", False), detach=getattr(args, "detach", False))


def recipe_argv(args: argparse.Namespace, repo: Path = REPO_ROOT) -> list[str]:
    """The ``submit.py recipe`` argv the host runs, from the launcher's parsed arguments.

    Config files travel inside the code archive, so they must lie in the repository.
    """
    argv = ["recipe", *args.stages, "--ngpu", str(args.ngpu)]
    cfg = Path(args.config).resolve()
    try:
        argv += ["--config", cfg.relative_to(repo.resolve()).as_posix()]
    except ValueError:
        raise HobsonError(f"--config {args.config} is outside the repository; the host gets only the "
                          "committed code: put it under configs/ and commit it") from None
    for flag, value in (("--seed", args.seed), ("--scale", args.scale), ("--teacher", args.teacher),
                        ("--train-config", getattr(args, "train_config", None)),
                        ("--parent-config", getattr(args, "parent_config", None)),
                        ("--ckpt", getattr(args, "ckpt", None)), ("--torso", getattr(args, "torso", None))):
        if value is not None:
            argv += [flag, str(value)]
    if getattr(args, "seeds", None):
        argv += ["--seeds", *map(str, args.seeds)]
    return argv




def cmd_recipe(args: argparse.Namespace) -> int:
    return _launch_recipe(args, backends.create(args.backend, _backend_options(args)))


def _launch_recipe(args: argparse.Namespace, backend: Backend, retry: bool = False) -> int:
    cfg, prof, digests = _load_recipe(args)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / new_run_id()
    paths = RunPaths.create(run_dir, args.logs_dir)
    ctx = dag.PlanContext(run_dir=str(paths.run_dir), ngpu=args.ngpu, config=cfg,
                          seed=cfg.corpus.seed, expected_rows=_expected_rows(cfg))
    absent = recorded_absence(paths) if paths.run_json.exists() else (lambda rel: "no named stage produces it")
    jobs = dag.plan(args.stages, ctx, absent)
    launch = Launch(paths, jobs, host_argv=lambda: recipe_argv(args))

    if args.dry_run:
        print(backend.dry_run(launch))
        print(f"# dry run: {len(jobs)} jobs, nothing submitted", file=sys.stderr)
        return 0

    with launcher_lock(paths, "retry" if retry else "launch"):
        return _record_and_launch_recipe(args, backend, retry, paths, launch, jobs, prof, cfg, digests)


def _refuse_active(paths: RunPaths, backend: Backend, what: str) -> None:
    if paths.run_json.exists():
        refuse_if_jobs_active(paths, backend.poll(read_run_json(paths)).states, what)


def _record_and_launch_recipe(args: argparse.Namespace, backend: Backend, retry: bool, paths: RunPaths,
                              launch: Launch, jobs: list[dag.JobSpec], prof: ClusterProfile, cfg: RecipeConfig,
                              digests: dict) -> int:
    _refuse_active(paths, backend, "retry" if retry else "launch")
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    options = {"stages": args.stages, "ngpu": args.ngpu, "config": str(args.config),
               "cluster": str(args.cluster), "partition": prof.partition, "account": prof.account,
               "scale": cfg.corpus.scale, "seed": cfg.corpus.seed, "teacher": cfg.teacher.model,
               "train_config": cfg.decider.train_config, "parent_config": cfg.decider.parent_config,
               "ckpt": cfg.decider.init_from, "torso": cfg.decider.torso, "seeds": cfg.decider.seeds}
    if paths.run_json.exists():
        meta = read_run_json(paths)
        meta.setdefault("invocations", []).append({"command": sys.argv, "options": options, "backend": backend.name})
    else:
        meta = new_run_json(paths, argv=sys.argv, backend=backend.name, options=options, config_digests=digests)
    # the latest invocation's backend answers status, logs, cancel and retry
    write_run_json(paths, backends.record(meta, backend))
    print(f"run {paths.run_dir.name}: {len(jobs)} jobs on the {backend.name} backend; record in {paths.run_dir}")
    code = backend.retry(launch) if retry else backend.launch(launch)
    if backend.waits:
        _print_where(paths, jobs, code)
    return code


def _print_where(paths: RunPaths, jobs: list[dag.JobSpec], code: int) -> None:
    print()
    print(f"{'finished' if code == 0 else f'stopped (exit {code})'}: run {paths.run_dir.name}")
    print(f"  record : {paths.run_json}")
    print(f"  stages : {paths.stages_jsonl}")
    print(f"  logs   : {paths.logs_dir}")
    last = {j.stage: j for j in jobs if not j.is_array}  # a stage's final job holds its results
    for job in last.values():
        outs = [paths.abs(o.split("=")[0]) for o in job.outputs]
        dirs = sorted({str(p.parent) for p in outs if p.exists()})
        if dirs:
            print(f"  {job.stage:<9}: " + ", ".join(dirs))
    report = paths.abs("eval/report.md")
    if code == 0 and any(j.stage == "eval" for j in jobs) and report.exists():
        # the overall and per-kind tables; per task and the pair sets are in the report
        text = report.read_text().split("## Per task")[0]
        print()
        print(text.strip())
        print(f"\n  report : {report}\n  plots  : {paths.abs('eval/reliability.png')}")
    print(f"  status : python launch/submit.py status {paths.run_dir}")


# ---------------------------------------------------------------------------------------------
# status / logs / cancel / retry / verify


def cmd_status(args: argparse.Namespace) -> int:
    paths = RunPaths.attach(args.run)
    backend = backends.for_run(paths)
    said = backend.status(paths)  # a remote backend mirrors the host's record first
    if said:
        print(said)
    print(status.render(paths, backend, all_shards=args.shards))
    serving = _serve_status(paths)
    if serving:
        print(serving)
    return 0


def _serve_status(paths: RunPaths) -> str | None:
    """Where a serve run's server listens, and what its /healthz says now."""
    import json

    from hobson.serve.client import ADDRESS, request

    address = paths.run_dir / ADDRESS
    if not address.is_file():
        return None
    a = json.loads(address.read_text(encoding="utf-8"))
    try:
        health = request(f"{a['url']}/healthz", timeout_s=3).get("status", "?")
    except HobsonError as e:
        health = f"not answering ({e})"
    return (f"serve: {a['url']} on node {a.get('node')} (pid {a.get('pid')}, since {a.get('started_utc')}): {health}\n"
            f"  ask it: python launch/submit.py ask --server {paths.run_dir} --state '...' --choice 'Q=a,b'")


def cmd_logs(args: argparse.Namespace) -> int:
    paths = RunPaths.attach(args.run)
    sys.stdout.write(backends.for_run(paths).logs(paths, args.stage, args.task))
    sys.stdout.flush()
    if args.follow and args.stage is not None:  # the log lies in the logs dir (remote ones are mirrored there)
        with open(paths.log(args.stage, args.task), errors="replace") as f:
            f.seek(0, 2)
            while True:
                line = f.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    paths = RunPaths.attach(args.run)
    print(backends.for_run(paths).cancel(paths))
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    """Re-plan the run's jobs and launch what did not finish (finished jobs and shards are skipped
    by their recorded digests), on the backend the run last used."""
    paths = RunPaths.attach(args.run)
    meta = read_run_json(paths)
    backend = backends.for_run(paths)
    if "rl" in (meta.get("options") or {}):
        return _launch_rl(_rl_launch_from_record(paths, meta), backend, retry=True, dry_run=args.dry_run)
    if "serve" in (meta.get("options") or {}):
        o = meta["options"]
        return _launch_serve(paths, backend, _serve_spec(o), o.get("host_argv", []), retry=True,
                             dry_run=args.dry_run)
    opts = meta["options"]
    ns = argparse.Namespace(
        stages=opts["stages"], ngpu=opts["ngpu"], config=Path(opts["config"]), cluster=Path(opts["cluster"]),
        partition=opts.get("partition"), account=opts.get("account"), scale=opts.get("scale"),
        seed=opts.get("seed"), teacher=opts.get("teacher"), train_config=opts.get("train_config"),
        parent_config=opts.get("parent_config"), ckpt=opts.get("ckpt"), torso=opts.get("torso"),
        seeds=opts.get("seeds"), run_dir=str(paths.run_dir),
        logs_dir=str(paths.logs_dir.parent), dry_run=args.dry_run,
    )
    cfg, _, _ = _load_recipe(ns)
    ctx = dag.PlanContext(run_dir=str(paths.run_dir), ngpu=ns.ngpu, config=cfg, seed=cfg.corpus.seed,
                          expected_rows=_expected_rows(cfg))
    jobs = dag.plan(ns.stages, ctx, recorded_absence(paths))
    records = read_stage_records(paths)
    todo = [j.name for j in jobs if not job_progress(j, paths, records).done]
    print(f"retry {paths.run_dir.name}: " + (", ".join(todo) if todo else "nothing left to run"))
    if not todo:
        return 0
    return _launch_recipe(ns, backend, retry=True)


def cmd_fetch(args: argparse.Namespace) -> int:
    """Remote runs: copy the run record, logs and outputs the host mirrored into the run directory."""
    paths = RunPaths.attach(args.run)
    backend = backends.for_run(paths)
    fetch = getattr(backend, "fetch", None)
    if fetch is None:
        raise HobsonError(f"fetch is for runs whose outputs live on a remote host (the aws backend); this run's "
                          f"({backend.name}) are already local")
    files = fetch(paths)
    print(f"fetched {len(files)} files into {paths.run_dir} and {paths.logs_dir}")
    return 0


def _passthrough(job: str):
    """Commands that run one job here and now (no run record): soup, compare, ask."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(f"hobson.jobs.{job}").main(args.rest) or 0

    return run


def cmd_verify(args: argparse.Namespace) -> int:
    paths = RunPaths.attach(args.run)
    expected: dict[str, tuple[str, str]] = {}
    for r in read_stage_records(paths):
        if r.get("status") != "ok":
            continue
        for o in r.get("outputs") or []:
            if o.get("sha256"):
                expected[o["path"]] = (o["sha256"], r["stage"])
    bad = 0
    for rel, (digest, stage) in sorted(expected.items()):
        p = paths.abs(rel)
        if not p.exists():
            print(f"MISSING  {rel} (stage {stage})")
            bad += 1
            continue
        actual = sha256_file(p)
        if actual != digest:
            print(f"CHANGED  {rel} (stage {stage}): recorded {digest}, now {actual}")
            bad += 1
        elif args.verbose:
            print(f"ok       {rel}")
    print(f"verify {paths.run_dir.name}: {len(expected) - bad}/{len(expected)} outputs match their record"
          + ("" if not bad else f"; {bad} differ"))
    corrupt = 0
    for what, (n, c) in _verify_manifests(paths, args.verbose).items():
        if n:
            print(f"verify {paths.run_dir.name}: {n - c}/{n} {what} match their manifests"
                  + (f"; {c} corrupt" if c else ""))
        corrupt += c
    return 1 if bad or corrupt else 0


def _verify_manifests(paths: RunPaths, verbose: bool) -> dict[str, tuple[int, int]]:
    """Re-hash every checkpoint under the run directory against its manifest (RL checkpoints, and
    decider checkpoints: trained, souped, calibrated) and every publication that still holds its
    weights (the digest of its tensors)."""
    import json

    from hobson import manifest
    from hobson.decider.checkpoint import verify_checkpoint as verify_decider
    from hobson.errors import DigestMismatch
    from hobson.rl.checkpoint import verify_checkpoint as verify_rl
    from hobson.rollout import publication

    def kind(d: Path) -> str | None:
        try:
            return json.loads((d / manifest.MANIFEST).read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            return "unreadable"

    rl = sorted(d for d in paths.run_dir.rglob("update-*") if d.is_dir() and d.parent.name == "checkpoints"
                and not d.name.endswith(".corrupt"))
    decider = sorted(m.parent for m in paths.run_dir.rglob(manifest.MANIFEST)
                     if ".corrupt" not in m.parent.name and kind(m.parent) == "decider-checkpoint")
    pubs = sorted(d for d in paths.run_dir.rglob("v*") if d.is_dir() and d.parent.name == "publications"
                  and (d / "config.json").is_file())
    groups = {"RL checkpoints and publications": [(d, verify_rl) for d in rl] + [(d, publication.verify) for d in pubs],
              "decider checkpoints": [(d, verify_decider) for d in decider]}
    counts = {}
    for what, checks in groups.items():
        corrupt = 0
        for d, check in checks:
            rel = d.relative_to(paths.run_dir)
            try:
                check(d)
            except (manifest.ManifestMismatch, DigestMismatch, publication.PublicationError) as e:
                print(f"CORRUPT  {rel}: {e}")
                corrupt += 1
                continue
            if verbose:
                print(f"ok       {rel}")
        counts[what] = (len(checks), corrupt)
    return counts


# ---------------------------------------------------------------------------------------------
# CLI


def _prog() -> str:
    """How the user called the launcher: the ``hobson`` console script or ``python launch/submit.py``."""
    return "hobson" if Path(sys.argv[0]).name == "hobson" else "python launch/submit.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_prog(), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("recipe", help="run the named stages of the decider recipe (or 'all') in DAG order",
                       description="Run exactly the named stages, in DAG order. Stages: "
                       + ", ".join(f"{s.name} ({s.help})" for s in dag.STAGES)
                       + ". 'all' = " + " ".join(dag.ALL) + ".")
    r.add_argument("stages", nargs="+", metavar="STAGE", help="stage names, or 'all'")
    r.add_argument("--backend", choices=BACKENDS, default=None,
                   help="where jobs run (default: slurm when sbatch is on PATH, else local)")
    r.add_argument("--ngpu", type=int, default=1,
                   help="GPUs to use: array stages run this many tasks at once, one GPU each (default 1)")
    r.add_argument("--run-dir", default=None,
                   help="run directory; reuse one to continue a run (default runs/<new run id>)")
    r.add_argument("--logs-dir", default=None,
                   help="root for logs; the run logs to <root>/<run-id>/ (default ./logs)")
    r.add_argument("--config", type=Path, default=DEFAULT_RECIPE,
                   help=f"recipe config YAML (default {DEFAULT_RECIPE.relative_to(REPO_ROOT)})")
    r.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER,
                   help="cluster profile YAML under configs/cluster/: partition, account, qos, constraint, "
                        "time limits per stage, extra #SBATCH lines")
    r.add_argument("--partition", default=None, help="Slurm partition (overrides the cluster profile)")
    r.add_argument("--account", default=None, help="Slurm account (overrides the cluster profile)")
    r.add_argument("--dry-run", action="store_true",
                   help="print every job that would be submitted (sbatch scripts for slurm) and submit nothing")
    r.add_argument("--seed", type=int, default=None, help="corpus generator seed (overrides corpus.seed)")
    r.add_argument("--scale", type=float, default=None,
                   help="corpus size multiplier (overrides corpus.scale; 1.0 is the pinned default)")
    r.add_argument("--teacher", default=None,
                   help="local HF causal-LM directory for the teacher (default: the embedded tiny teacher)")
    r.add_argument("--train-config", default=None,
                   help="training config of the final model (overrides decider.train_config; default "
                        "configs/train.yaml)")
    r.add_argument("--parent-config", default=None,
                   help="training config of the parent (overrides decider.parent_config)")
    r.add_argument("--ckpt", default=None,
                   help="fine-tune the final model from this decider checkpoint (init_from)")
    r.add_argument("--torso", default=None,
                   help="base causal-LM directory for parent and final model (default: the teacher's)")
    r.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="`recipe release`: one final model per seed, then souped (default 0 1 2)")
    r.add_argument("--aws-config", type=Path, default=None,
                   help="aws backend: instance types, regions, bucket, host settings (default configs/aws.yaml)")
    r.add_argument("--allow-dirty", action="store_true",
                   help="aws backend: ship uncommitted changes (and their diff) instead of refusing a dirty tree")
    r.add_argument("--detach", action="store_true",
                   help="aws backend: return once the run started on the host; follow it later with status")
    r.set_defaults(fn=cmd_recipe)

    s = sub.add_parser("status", help="each stage of a run with state, wall time, rows and sha256")
    s.add_argument("run", help="run directory or run id")
    s.add_argument("--shards", action="store_true", help="list every shard of large arrays")
    s.set_defaults(fn=cmd_status)

    lg = sub.add_parser("logs", help="print a stage's log (no stage: list the run's logs)")
    lg.add_argument("run", help="run directory or run id")
    lg.add_argument("stage", nargs="?", help="job name as status shows it, e.g. teacher or teacher-merge")
    lg.add_argument("--task", type=int, default=None, help="array task index")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing as the log grows")
    lg.set_defaults(fn=cmd_logs)

    c = sub.add_parser("cancel", help="stop a run's jobs")
    c.add_argument("run", help="run directory or run id")
    c.set_defaults(fn=cmd_cancel)

    rt = sub.add_parser("retry", help="resubmit only what did not finish (missing shards, failed stages)")
    rt.add_argument("run", help="run directory or run id")
    rt.add_argument("--dry-run", action="store_true", help="print what would be resubmitted")
    rt.set_defaults(fn=cmd_retry)

    f = sub.add_parser("fetch", help="aws runs: copy records, logs and outputs from S3 into the run directory")
    f.add_argument("run", help="run directory or run id")
    f.set_defaults(fn=cmd_fetch)

    for name, job, text in (
            ("soup", "soup", "average decider checkpoints into one (LoRA mean, heads ensembled): CKPT... --out DIR"),
            ("compare", "compare", "McNemar's exact test per task between two evaluations: EVAL_A EVAL_B"),
            ("ask", "ask", "ask a checkpoint: CKPT --state '...' --choice 'Q=a,b'"),
            ("verify-resume", "verify_resume", "compare two RL runs item by item (bit for bit): RUN_A RUN_B; "
             "or --record RUN_A > a.json (digests only), then a.json RUN_B"),
            ("rl", "rl", "recurrent-policy RL (ppo, grpo, dppo, flow-dppo) as a recorded run; rl --help"),
            ("serve", "serve", "serve a decider checkpoint over HTTP as a recorded run: CKPT; serve --help")):
        sp = sub.add_parser(name, help=text, add_help=False,
                            description=f"{text}. Runs hobson.jobs.{job} here; `{name} --help` lists its flags.")
        sp.add_argument("rest", nargs=argparse.REMAINDER, help=f"arguments of python -m jobs.{job}")
        sp.set_defaults(fn=_passthrough(job))

    v = sub.add_parser("verify", help="re-hash every output of a run against its record, and its RL checkpoints "
                                      "and publications against their manifests")
    v.add_argument("run", help="run directory or run id")
    v.add_argument("-v", "--verbose", action="store_true", help="also list outputs that match")
    v.set_defaults(fn=cmd_verify)
    return p


PASSTHROUGH = {"soup": "soup", "compare": "compare", "ask": "ask", "verify-resume": "verify_resume"}

RL_USAGE = """python launch/submit.py rl [--backend local|slurm|aws] [--ngpu N] [--run-dir DIR] [--dry-run] [RL FLAGS]

Recurrent-policy RL (PPO, GRPO, DPPO, Flow-DPPO) as a recorded run. Every flag that is not the
launcher's goes to `python -m jobs.rl` (see `python -m jobs.rl --help`): --algorithm, --model,
--data, --updates, --stop-after, --resume, --model-revision, --engine-revision, ... Without
--output the RL run writes to <run dir>/rl. On Slurm it runs as ONE heterogeneous job rendered
from these flags (launch/backends/slurm_scripts.py; the same job as sbatch/<algorithm>.sh): component 0 trains
on --ngpu GPUs, component 1 serves rollouts on --rollout-gpus GPUs; --dry-run prints the script.
--colocated: one single-component job instead, both on one node, GPUs split (for clusters that
disable heterogeneous jobs)."""


@dataclass
class _RLRun:
    """An RL launch as the record keeps it (``retry`` rebuilds it from run.json alone)."""

    paths: RunPaths
    rl_args: list[str]  # python -m jobs.rl flags
    outputs: list[str]
    ngpu: int = 1
    rollout_gpus: int = 1
    colocated: bool = False
    cluster: str = str(DEFAULT_CLUSTER)
    host_argv: list[str] = field(default_factory=list)
    resources: dict[str, dict] | None = None  # per component, as a plain-sbatch job recorded them

    def job(self, retry: bool) -> dag.JobSpec:
        args = list(self.rl_args)
        out = dag.flag_value(args, "--output")
        if retry and "--resume" not in args and out and (Path(out) / "run.json").exists():
            args.append("--resume")  # continue from the newest intact checkpoint, bit for bit
        servers = dag.flag_value(args, "--rollout-servers") or "1"
        return dag.rl_job(args, self.outputs, train_gpus=self.ngpu, rollout_gpus=self.rollout_gpus,
                          colocated=self.colocated, resources=self.resources,
                          rollout_servers=int(servers) if servers.isdigit() else 1)


def _launcher_flags(p: argparse.ArgumentParser) -> None:
    """The flags `rl` and `serve` take for the launcher itself; everything else goes to their job."""
    p.add_argument("--backend", choices=BACKENDS, default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--logs-dir", default=None)
    p.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER)
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--aws-config", type=Path, default=None)
    p.add_argument("--allow-dirty", action="store_true")
    p.add_argument("--detach", action="store_true")
    p.add_argument("--dry-run", action="store_true")


def cmd_rl(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{_prog()} rl", usage=RL_USAGE, add_help=False)
    _launcher_flags(p)
    p.add_argument("--ngpu", type=int, default=1)
    p.add_argument("--colocated", action="store_true")
    p.add_argument("--rollout-gpus", type=int, default=1)
    p.add_argument("-h", "--help", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.help:
        print(RL_USAGE)
        return 0
    backend = backends.create(args.backend, _backend_options(args))
    paths = RunPaths.create(Path(args.run_dir) if args.run_dir else Path("runs") / new_run_id(), args.logs_dir)
    outputs = []
    if "--output" not in rest:  # the RL run lives inside the launcher's run directory, its metrics recorded
        rest += ["--output", str(paths.run_dir / "rl")]
        outputs = ["rl/metrics.jsonl"]
    host = ["rl", "--ngpu", str(args.ngpu), *[a for a in argv if a not in ("--detach", "--allow-dirty")]]
    run = _RLRun(paths, rest, outputs, max(args.ngpu, 1), args.rollout_gpus, args.colocated, str(args.cluster), host)
    return _launch_rl(run, backend, retry=False, dry_run=args.dry_run)


def _rl_launch_from_record(paths: RunPaths, meta: dict) -> _RLRun:
    o = meta["options"]
    return _RLRun(paths, list(o["rl"]), list(o.get("outputs", ["rl/metrics.jsonl"])), int(o.get("ngpu", 1)),
                  int(o.get("rollout_gpus", 1)), bool(o.get("colocated", False)),
                  o.get("cluster", str(DEFAULT_CLUSTER)), list(o.get("host_argv", [])), o.get("resources"))


def _launch_rl(run: _RLRun, backend: Backend, *, retry: bool, dry_run: bool) -> int:
    paths = run.paths
    launch = Launch(paths, [run.job(retry)], host_argv=lambda: run.host_argv)
    if dry_run:
        print(backend.dry_run(launch))
        return 0
    with launcher_lock(paths, "retry" if retry else "launch"):
        _refuse_active(paths, backend, "retry" if retry else "launch")
        return _record_and_launch_rl(run, backend, retry, launch)


def _record_and_launch_rl(run: _RLRun, backend: Backend, retry: bool, launch: Launch) -> int:
    paths = run.paths
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    options = {"rl": run.rl_args, "outputs": run.outputs, "ngpu": run.ngpu, "rollout_gpus": run.rollout_gpus,
               "colocated": run.colocated, "cluster": run.cluster, "host_argv": run.host_argv}
    if paths.run_json.exists():
        meta = read_run_json(paths)
        meta.setdefault("invocations", []).append({"command": sys.argv, "options": options, "backend": backend.name})
    else:
        meta = new_run_json(paths, argv=sys.argv, backend=backend.name, options=options, config_digests={})
    write_run_json(paths, backends.record(meta, backend))
    print(f"run {paths.run_dir.name}: rl on the {backend.name} backend; record in {paths.run_dir}")
    code = backend.retry(launch) if retry else backend.launch(launch)
    if backend.waits:
        print(f"{'finished' if code == 0 else f'stopped (exit {code})'}: logs in {paths.log('rl')}")
    return code


SERVE_USAGE = """python launch/submit.py serve CKPT [--backend local|slurm|aws] [--host H] [--port N]
    [--max-batch-tokens N] [--device cpu|cuda] [--run-dir DIR] [--time HH:MM:SS] [--dry-run] [SERVE FLAGS]

A decider checkpoint behind HTTP (python -m jobs.serve --help lists the endpoints and every flag
not named here) as a recorded run: `status RUN` shows where it listens and whether it is ready,
`ask --server RUN` asks it, `cancel RUN` stops it, `logs RUN serve` shows its log. Locally it runs
in the foreground on 127.0.0.1:8000 (Ctrl-C stops it). On Slurm it is a job (one GPU with
--device cuda) that listens on its node's address, on a free port, guarded by a bearer token the
launcher writes to <run>/serve/token (mode 0600); its address goes to <run>/serve/address.json."""


def cmd_serve(argv: list[str]) -> int:
    from hobson.serve.client import ADDRESS

    p = argparse.ArgumentParser(prog=f"{_prog()} serve", usage=SERVE_USAGE, add_help=False)
    p.add_argument("checkpoint", nargs="?")
    _launcher_flags(p)
    p.add_argument("--time", default="24:00:00")
    p.add_argument("--host", default=None)
    p.add_argument("--port", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--token-file", default=None)
    p.add_argument("-h", "--help", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.help:
        print(SERVE_USAGE)
        return 0
    if not args.checkpoint:
        raise HobsonError(f"serve: give the checkpoint directory: {SERVE_USAGE.splitlines()[0]}")
    if not Path(args.checkpoint).is_dir():
        raise HobsonError(f"serve: {args.checkpoint}: no such checkpoint directory")
    args.ngpu = 1
    backend = backends.create(args.backend, _backend_options(args))
    paths = RunPaths.create(Path(args.run_dir) if args.run_dir else Path("runs") / new_run_id(), args.logs_dir)
    # A job on another machine must listen where the launcher's side can reach it, and then a
    # token guards it; on this machine the server stays on loopback.
    host = args.host or ("node" if backend.remote else "127.0.0.1")
    port = args.port or ("0" if backend.remote else "8000")
    job_args = [str(Path(args.checkpoint).resolve()), "--host", host, "--port", port, "--device", args.device,
                "--address-file", str((paths.run_dir / ADDRESS).resolve())]
    token_file = args.token_file
    if token_file is None and host not in ("127.0.0.1", "localhost", "::1"):
        from hobson.rollout.transport import make_secret

        token_file = str((paths.run_dir / "serve" / "token").resolve())
        if not args.dry_run:
            make_secret(token_file)  # mode 0600 from its first byte
    if token_file:
        job_args += ["--token-file", token_file]
    spec = {"serve": [*job_args, *rest], "gpus": 1 if args.device.startswith("cuda") else 0, "time": args.time}
    host_argv = ["serve", *[a for a in argv if a not in ("--detach", "--allow-dirty")]]
    return _launch_serve(paths, backend, spec, host_argv, retry=False, dry_run=args.dry_run)


def _serve_spec(options: dict) -> dict:
    return {"serve": list(options["serve"]), "gpus": int(options.get("gpus", 0)), "time": options["time"]}


def _launch_serve(paths: RunPaths, backend: Backend, spec: dict, host_argv: list[str], *, retry: bool,
                  dry_run: bool) -> int:
    from hobson.serve.client import ADDRESS

    job = dag.serve_job(spec["serve"], gpus=spec["gpus"], time=spec["time"])
    launch = Launch(paths, [job], host_argv=lambda: host_argv)
    if dry_run:
        print(backend.dry_run(launch))
        return 0
    with launcher_lock(paths, "retry" if retry else "launch"):
        _refuse_active(paths, backend, "retry" if retry else "launch")
        paths.run_dir.mkdir(parents=True, exist_ok=True)
        options = {**spec, "host_argv": host_argv}
        if paths.run_json.exists():
            meta = read_run_json(paths)
            meta.setdefault("invocations", []).append({"command": sys.argv, "options": options,
                                                       "backend": backend.name})
        else:
            meta = new_run_json(paths, argv=sys.argv, backend=backend.name, options=options, config_digests={})
        write_run_json(paths, backends.record(meta, backend))
        print(f"run {paths.run_dir.name}: serve on the {backend.name} backend; its address goes to "
              f"{paths.run_dir / ADDRESS} (status {paths.run_dir} shows it; ask --server {paths.run_dir} asks it; "
              f"log: logs {paths.run_dir} serve)", flush=True)
        code = backend.retry(launch) if retry else backend.launch(launch)
    if backend.waits:
        print(f"serve {'stopped' if code == 0 else f'failed (exit {code})'}: log in {paths.log('serve')}")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:  # their own parsers own every flag, --help included
        return _passthrough(PASSTHROUGH[argv[0]])(argparse.Namespace(rest=argv[1:]))
    try:
        if argv and argv[0] == "rl":
            return cmd_rl(argv[1:])
        if argv and argv[0] == "serve":
            return cmd_serve(argv[1:])
        args = build_parser().parse_args(argv)
        return args.fn(args)
    except HobsonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a bug: one message and the traceback in a file, unless HOBSON_DEBUG=1
        return internal_error(e, "submit.py")


if __name__ == "__main__":
    sys.exit(main())
