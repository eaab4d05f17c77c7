"""The recipe's stage DAG, defined once, and the planner every backend reads.

A :class:`Stage` declares its job entry point, inputs, outputs, resources and (for labelling)
array width. :func:`plan` turns the stages a user named into concrete :class:`JobSpec` s, in
DAG order, with dependencies derived from inputs and outputs. The local backend runs these as
subprocesses; the Slurm renderer turns each into one sbatch script. Neither adds anything a
stage depends on, so a stage's results do not depend on the backend.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from hobson.errors import StageError
from hobson.launch.options import RecipeConfig
from hobson.shards import format_spec


@dataclass(frozen=True)
class Resources:
    gpus: int = 0  # per task (array stages) or per node
    cpus: int = 1  # also torch's thread count, on every backend
    mem_gb: int = 4
    time: str = "00:30:00"
    nodes: int = 1


@dataclass(frozen=True)
class Component:
    """One part of a job that runs as its own process(es) with its own resources: a recipe
    stage is one component; an RL run is ``training`` plus ``rollout`` (a heterogeneous Slurm
    job, or both on one node when the job is ``colocated``)."""

    name: str
    tasks: int
    resources: Resources


@dataclass
class JobSpec:
    """One submission: a single job, or an array whose task k runs shard ``shards[k]``.

    Every job is a list of components (:attr:`parts`). A recipe stage is one component, which
    ``components`` leaves implicit (its resources are ``resources``, its tasks the array's shards
    or one); a job of several components (the RL run) lists each, ``resources`` then being the first's.
    """

    name: str  # unique within a plan, e.g. "teacher" or "teacher-merge"
    stage: str  # the user-facing stage it belongs to
    job: str  # runs hobson.jobs.<job>.main(job_args)
    job_args: list[str]
    inputs: list[str]  # paths relative to the run directory
    outputs: list[str]  # "REL[=ROWS]"; "{shard}" is filled in per array task
    resources: Resources
    after: list[str] = field(default_factory=list)
    shards: list[int] | None = None
    num_shards: int | None = None
    throttle: int | None = None
    launcher: str = "python"  # or "torchrun" (multi-GPU training stages)
    components: list[Component] = field(default_factory=list)
    colocated: bool = False  # several components on one node (clusters without heterogeneous jobs)

    @property
    def is_array(self) -> bool:
        return self.shards is not None

    @property
    def parts(self) -> list[Component]:
        """The job's components: those listed, or the one a recipe stage is."""
        return self.components or [Component(self.name, len(self.shards) if self.shards is not None else 1,
                                             self.resources)]

    @property
    def heterogeneous(self) -> bool:
        """Several components: one Slurm job of several (``+0``, ``+1``, ...), or one node when colocated."""
        return len(self.parts) > 1

    def stagerun_args(self, run_dir: str, shards: list[int] | None = None) -> list[str]:
        """Arguments of ``python -m hobson.stagerun`` that run this job and record it.

        ``shards`` narrows an array to some of its shards (a retry, or one part of a split array).
        """
        argv = ["-m", "hobson.stagerun", "--run-dir", run_dir, "--stage", self.name, "--job", self.job,
                "--gpus", str(self.resources.gpus), "--cpus", str(self.resources.cpus)]
        if self.launcher == "torchrun":
            argv += ["--torchrun", str(max(self.resources.gpus, 1))]
        if self.shards is not None:
            argv += ["--shards", format_spec(self.shards if shards is None else shards)]
        for o in self.outputs:
            argv += ["--output", o]
        return argv + ["--"] + self.job_args

    def command(self, run_dir: str, python: str = "python") -> str:
        return shlex.join([python, *self.stagerun_args(run_dir)])


@dataclass(frozen=True)
class PlanContext:
    run_dir: str
    ngpu: int
    config: RecipeConfig
    seed: int
    expected_rows: Callable[[str], int | None]


@dataclass(frozen=True)
class Stage:
    name: str
    jobs: Callable[[PlanContext], list[JobSpec]]
    after_if_named: tuple[str, ...] = ()  # ordering-only edges (optional inputs such as raw data)
    help: str = ""


# ---------------------------------------------------------------------------------------------
# the decider recipe

CORPUS_OUTPUTS = {
    "build": ["build/train.jsonl", "build/eval.jsonl"],
    "multistep": ["multistep/train.jsonl", "multistep/eval.jsonl"],
    "generated": ["generated/train.jsonl", "generated/eval.jsonl", "generated/consistency.jsonl",
                  "generated/flip.jsonl"],
    "adequacy": ["adequacy/train.jsonl", "adequacy/eval.jsonl"],
    "catchall": ["catchall/train.jsonl", "catchall/eval.jsonl"],
}
TEACHER_CORPUS = "data/multistep/train.jsonl"
# Training files in the order the training set concatenates them; the teacher's rows are
# shifted by the line counts of the files before its corpus.
TRAIN_FILES = [f"data/{s}/train.jsonl" for s in ("build", "multistep", "generated", "adequacy", "catchall")]
EVAL_FILES = [f.replace("/train.jsonl", "/eval.jsonl") for f in TRAIN_FILES]
CHECKPOINT_FILES = ("adapter.safetensors", "head.safetensors", "config.json")


def _with_rows(ctx: PlanContext, rel: str) -> str:
    rows = ctx.expected_rows(rel)
    return rel if rows is None else f"{rel}={rows}"


def _corpus_stage(name: str) -> Callable[[PlanContext], list[JobSpec]]:
    def jobs(ctx: PlanContext) -> list[JobSpec]:
        c = ctx.config.corpus
        outs = [f"data/{p}" for p in CORPUS_OUTPUTS[name]]
        return [JobSpec(
            name=name, stage=name, job=name,
            job_args=["--data-dir", f"{ctx.run_dir}/data", "--scale", repr(c.scale), "--seed", str(c.seed)],
            inputs=[], outputs=[_with_rows(ctx, o) for o in outs] + [f"data/{name}/SHA256SUMS"],
            resources=Resources(cpus=1, mem_gb=4, time="00:30:00"),
        )]
    return jobs


def _fetch(ctx: PlanContext) -> list[JobSpec]:
    return [JobSpec(
        name="fetch", stage="fetch", job="fetch",
        job_args=["--data-dir", f"{ctx.run_dir}/data", "--config", ctx.config.corpus.fetch_config],
        inputs=[], outputs=["data/raw/MANIFEST.json"],
        resources=Resources(cpus=1, mem_gb=2, time="02:00:00"),
    )]


def _labelling(name: str, job: str, corpus: str, out: str, model_args: Callable[[PlanContext], list[str]],
               num_shards: Callable[[PlanContext], int], extra_inputs: Callable[[PlanContext], list[str]],
               max_tokens: Callable[[PlanContext], int], max_rows: Callable[[PlanContext], int],
               ) -> Callable[[PlanContext], list[JobSpec]]:
    """An array that labels ``corpus`` in whole-batch shards, then a merge job after it."""

    def jobs(ctx: PlanContext) -> list[JobSpec]:
        n = num_shards(ctx)
        stem = out[: -len(".jsonl")]
        rows = ctx.expected_rows(corpus)
        with_rows = lambda rel: rel if rows is None else f"{rel}={rows}"  # one output row per corpus row
        shard_out = f"{stem}.shard{{shard}}of{n}.jsonl"
        array = JobSpec(
            name=name, stage=name, job=job,
            job_args=["--corpus", f"{ctx.run_dir}/{corpus}", "--out", f"{ctx.run_dir}/{out}",
                      "--num-shards", str(n), "--shards", "{shards}",
                      "--max-batch-tokens", str(max_tokens(ctx)), "--max-batch-rows", str(max_rows(ctx)),
                      *model_args(ctx)],
            inputs=[corpus, *extra_inputs(ctx)], outputs=[shard_out, shard_out + ".done"],
            resources=Resources(gpus=1, cpus=2, mem_gb=16, time="02:00:00"),
            shards=list(range(n)), num_shards=n, throttle=min(n, max(ctx.ngpu, 1)),
        )
        preceding = TRAIN_FILES[: TRAIN_FILES.index(corpus)] if corpus in TRAIN_FILES else []
        train_out = f"{stem}_train.jsonl"
        merge = JobSpec(
            name=f"{name}-merge", stage=name, job="teacher_merge",
            job_args=["--out", f"{ctx.run_dir}/{out}", "--num-shards", str(n)]
            + (["--expected-rows", str(rows)] if rows is not None else [])
            + (["--shift-by", *[f"{ctx.run_dir}/{p}" for p in preceding]] if preceding else []),
            inputs=preceding,
            outputs=[with_rows(out)] + ([with_rows(train_out)] if preceding else []),
            resources=Resources(cpus=1, mem_gb=8, time="00:30:00"), after=[name],
        )
        return [array, merge]

    return jobs


def _teacher_model_args(ctx: PlanContext) -> list[str]:
    t = ctx.config.teacher
    return ["--teacher", t.model] if t.model else ["--default-teacher-dir", f"{ctx.run_dir}/models/teacher"]


def _default_shards(ctx: PlanContext) -> int:
    return ctx.config.teacher.shards or max(ctx.ngpu, 1)


def _abs(ctx: PlanContext, rels: list[str]) -> list[str]:
    return [f"{ctx.run_dir}/{r}" for r in rels]


def _checkpoint(rel_dir: str) -> list[str]:
    return [f"{rel_dir}/{f}" for f in CHECKPOINT_FILES]


def _training(name: str, config: Callable[[PlanContext], str], teacher_file: str, out_dir: str,
              init_from: Callable[[PlanContext], str | None] = lambda ctx: None,
              ) -> Callable[[PlanContext], list[JobSpec]]:
    """A torchrun job of ``--ngpu`` ranks; DDP trains exactly the one-process gradient."""

    def jobs(ctx: PlanContext) -> list[JobSpec]:
        torso = _torso(ctx)
        overrides = [f"base_model={torso}", f"train_files=[{','.join(_abs(ctx, TRAIN_FILES))}]",
                     f"teacher_files=[{ctx.run_dir}/{teacher_file}]", "val_file=null",
                     f"output_dir={ctx.run_dir}/{out_dir}"]
        if (ckpt := init_from(ctx)) is not None:
            overrides.append(f"init_from={ckpt}")
        return [JobSpec(
            name=name, stage=name, job="train", launcher="torchrun",
            job_args=["--config", _config_path(config(ctx)), *overrides],
            inputs=[*TRAIN_FILES, teacher_file], outputs=_checkpoint(f"{out_dir}/final"),
            resources=Resources(gpus=max(ctx.ngpu, 1), cpus=1, mem_gb=32, time="08:00:00"),
        )]

    return jobs


def _torso(ctx: PlanContext) -> str:
    """The base LM: decider.torso, else the teacher model, else the embedded tiny model the teacher built."""
    return ctx.config.decider.torso or ctx.config.teacher.model or f"{ctx.run_dir}/models/teacher"


def _config_path(p: str) -> str:
    from pathlib import Path

    from hobson.records import REPO_ROOT

    path = Path(p)
    return str(path.resolve() if path.exists() else REPO_ROOT / p)


def _distill(ctx: PlanContext) -> list[JobSpec]:
    rows = ctx.expected_rows(TEACHER_CORPUS)
    out = "labels/final_teacher.jsonl"
    return [JobSpec(
        name="distill", stage="distill", job="distill",
        job_args=["--train-files", *_abs(ctx, TRAIN_FILES), "--teacher", f"{ctx.run_dir}/labels/teacher_train.jsonl",
                  "--replay", f"{ctx.run_dir}/labels/replay_train.jsonl", "--out", f"{ctx.run_dir}/{out}"],
        inputs=[*TRAIN_FILES, "labels/teacher_train.jsonl", "labels/replay_train.jsonl"],
        outputs=[out if rows is None else f"{out}={rows}"], resources=Resources(cpus=1, mem_gb=8),
    )]


def _calibrate(ctx: PlanContext) -> list[JobSpec]:
    return [JobSpec(
        name="calibrate", stage="calibrate", job="calibrate",
        job_args=["--checkpoint", f"{ctx.run_dir}/train/final", "--out", f"{ctx.run_dir}/calibrated",
                  "--eval-files", *_abs(ctx, EVAL_FILES), "--min-kind-rows", str(ctx.config.decider.min_kind_rows)],
        inputs=[*_checkpoint("train/final"), *EVAL_FILES],
        outputs=[*_checkpoint("calibrated"), "calibrated/temperatures.json"],
        resources=Resources(gpus=1, cpus=2, mem_gb=16, time="01:00:00"),
    )]


def _eval_args(ctx: PlanContext) -> list[str]:
    return ["--eval-files", *_abs(ctx, EVAL_FILES), "--catchall", f"{ctx.run_dir}/data/catchall/eval.jsonl",
            "--consistency", f"{ctx.run_dir}/data/generated/consistency.jsonl",
            "--flip", f"{ctx.run_dir}/data/generated/flip.jsonl"]


EVAL_INPUTS = [*EVAL_FILES, "data/generated/consistency.jsonl", "data/generated/flip.jsonl"]
REPORT_FILES = ("report.json", "report.md", "predictions.jsonl", "reliability.png")


def _eval(ctx: PlanContext) -> list[JobSpec]:
    return [JobSpec(
        name="eval", stage="eval", job="evaluate",
        job_args=["--checkpoint", f"{ctx.run_dir}/calibrated", "--out", f"{ctx.run_dir}/eval", *_eval_args(ctx)],
        inputs=[*_checkpoint("calibrated"), *EVAL_INPUTS], outputs=[f"eval/{f}" for f in REPORT_FILES],
        resources=Resources(gpus=1, cpus=2, mem_gb=16, time="01:00:00"),
    )]


def _release(ctx: PlanContext) -> list[JobSpec]:
    """One final model per seed (an array, one GPU each), then soup, calibrate and evaluate the soup."""
    d = ctx.config.decider
    seeds = sorted(set(d.seeds))
    torso = _torso(ctx)
    train = JobSpec(  # a one-rank torchrun per seed, so a preempted task checkpoints and requeues itself
        name="release-train", stage="release", job="train", launcher="torchrun",
        job_args=["--config", _config_path(d.train_config), f"base_model={torso}",
                  f"train_files=[{','.join(_abs(ctx, TRAIN_FILES))}]",
                  f"teacher_files=[{ctx.run_dir}/labels/final_teacher.jsonl]", "val_file=null",
                  "seed={shard}", f"output_dir={ctx.run_dir}/seeds/{{shard}}"],
        inputs=[*TRAIN_FILES, "labels/final_teacher.jsonl"], outputs=_checkpoint("seeds/{shard}/final"),
        resources=Resources(gpus=1, cpus=2, mem_gb=32, time="08:00:00"),
        shards=seeds, num_shards=len(seeds), throttle=min(len(seeds), max(ctx.ngpu, 1)),
    )
    soup = JobSpec(
        name="release-soup", stage="release", job="release",
        job_args=[*[f"{ctx.run_dir}/seeds/{s}/final" for s in seeds], "--out", f"{ctx.run_dir}/release",
                  *_eval_args(ctx)],
        inputs=EVAL_INPUTS, outputs=[f"release/eval/{f}" for f in REPORT_FILES],
        resources=Resources(gpus=1, cpus=2, mem_gb=16, time="02:00:00"), after=["release-train"],
    )
    return [train, soup]


STAGES: list[Stage] = [
    Stage("build", _corpus_stage("build"), after_if_named=("fetch",), help="short-task rows"),
    Stage("fetch", _fetch, help="public raw datasets listed in the fetch config"),
    Stage("multistep", _corpus_stage("multistep"), after_if_named=("fetch",), help="2-3-hop rows"),
    Stage("generated", _corpus_stage("generated"), after_if_named=("fetch",),
          help="generated questions, paraphrase and flip eval sets"),
    Stage("adequacy", _corpus_stage("adequacy"), after_if_named=("fetch",), help="request/response adequacy"),
    Stage("catchall", _corpus_stage("catchall"), after_if_named=("fetch",), help="'none of these' rows"),
    Stage("teacher", _labelling(
        "teacher", "teacher", TEACHER_CORPUS, "labels/teacher.jsonl", _teacher_model_args, _default_shards,
        extra_inputs=lambda ctx: [], max_tokens=lambda ctx: ctx.config.teacher.max_batch_tokens,
        max_rows=lambda ctx: ctx.config.teacher.max_batch_rows),
        help="label the multi-step rows with the frozen teacher (array + merge)"),
    Stage("parent", _training("parent", lambda ctx: ctx.config.decider.parent_config, "labels/teacher_train.jsonl",
                              "parent"), help="train the parent (torchrun over --ngpu ranks)"),
    Stage("replay", _labelling(
        "replay", "replay", TEACHER_CORPUS, "labels/replay.jsonl",
        lambda ctx: ["--checkpoint", f"{ctx.run_dir}/parent/final"],
        lambda ctx: ctx.config.decider.replay_shards or max(ctx.ngpu, 1),
        extra_inputs=lambda ctx: _checkpoint("parent/final"),
        max_tokens=lambda ctx: ctx.config.decider.replay_max_batch_tokens,
        max_rows=lambda ctx: ctx.config.decider.replay_max_batch_rows),
        help="label the multi-step rows with the parent (array + merge)"),
    Stage("distill", _distill,
          help="final targets: teacher rows that agree with gold, replay for the rest (alone: the frozen-targets "
               "route from existing teacher and replay files, no parent)"),
    Stage("train", _training("train", lambda ctx: ctx.config.decider.train_config, "labels/final_teacher.jsonl",
                             "train", init_from=lambda ctx: ctx.config.decider.init_from),
          help="train the final model (torchrun over --ngpu ranks)"),
    Stage("calibrate", _calibrate, help="fit temperatures on the held-out calibration half"),
    Stage("eval", _eval, help="accuracy, ECE, NLL, Brier per kind and task; report and reliability diagram"),
    Stage("release", _release, help="one final model per seed (--seeds), souped, calibrated and evaluated"),
]
# `fetch` is listed after `build` above for readability of `--help`; DAG order comes from edges.
ALL = ["build", "fetch", "multistep", "generated", "adequacy", "catchall", "teacher", "parent", "replay", "distill",
       "train", "calibrate", "eval"]
BY_NAME = {s.name: s for s in STAGES}


def expand_stage_names(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        if n == "all":
            out += ALL
        elif n in BY_NAME:
            out.append(n)
        else:
            raise StageError(f"unknown stage {n!r}; stages: {', '.join(ALL)} (or 'all')")
    return list(dict.fromkeys(out))


def plan(names: list[str], ctx: PlanContext, absent: Callable[[str], str | None]) -> list[JobSpec]:
    """Concrete jobs for the named stages, in DAG order.

    ``absent(rel)`` is None when an input already exists with its recorded digest, else the
    reason it is not usable. An input neither produced by a named stage nor present is refused,
    naming it and the reason.
    """
    names = expand_stage_names(names)
    specs = {n: BY_NAME[n].jobs(ctx) for n in names}
    producer: dict[str, str] = {}
    for jobs in specs.values():
        for j in jobs:
            for o in j.outputs:
                producer[o.split("=")[0]] = j.name
    missing = []
    for jobs in specs.values():
        for j in jobs:
            for i in j.inputs:
                if i in producer:
                    if producer[i] not in j.after:
                        j.after.append(producer[i])
                elif (why := absent(i)) is not None:
                    missing.append(f"{j.stage}: needs {i}: {why}")
    if missing:
        raise StageError("cannot plan:\n  " + "\n  ".join(missing)
                         + "\nname the stage that produces it, or run it first in this --run-dir")
    for n in names:
        for dep in BY_NAME[n].after_if_named:
            if dep in specs:
                first = specs[n][0]
                last_of_dep = specs[dep][-1].name
                if last_of_dep not in first.after:
                    first.after.append(last_of_dep)
    return _toposort([j for n in names for j in specs[n]])


def _toposort(jobs: list[JobSpec]) -> list[JobSpec]:
    """Kahn's algorithm, stable: among ready jobs keep the order the stages were listed in."""
    by = {j.name: j for j in jobs}
    done: set[str] = set()
    out: list[JobSpec] = []
    while len(out) < len(jobs):
        ready = [j for j in jobs if j.name not in done and all(a in done or a not in by for a in j.after)]
        if not ready:
            raise StageError("cycle in the stage DAG: " + ", ".join(j.name for j in jobs if j.name not in done))
        out.append(ready[0])
        done.add(ready[0].name)
    return out


# ---------------------------------------------------------------------------------------------
# the RL job

RL_TRAINING, RL_ROLLOUT = "training", "rollout"


def serve_job(job_args: list[str], *, gpus: int = 0, cpus: int = 4, mem_gb: int = 16,
              time: str = "24:00:00") -> JobSpec:
    """A decider server (``hobson.jobs.serve``) as one job: no outputs, so it is never "done" and a
    retry starts it again; its address lands where ``job_args`` say (``--address-file``)."""
    return JobSpec(name="serve", stage="serve", job="serve", job_args=list(job_args), inputs=[], outputs=[],
                   resources=Resources(gpus=gpus, cpus=cpus, mem_gb=mem_gb, time=time))


def rl_job(job_args: list[str], outputs: list[str], *, train_gpus: int = 1, rollout_gpus: int = 1,
           colocated: bool = False, resources: dict[str, dict] | None = None, rollout_servers: int = 1) -> JobSpec:
    """The RL run as one job of two components: ``training`` (one task on ``train_gpus``) and
    ``rollout`` (``rollout_servers`` tasks, one rollout server each, on ``rollout_gpus`` each).
    Backends that run both in one process (local, the AWS host) start the training component, whose engine then runs in
    process; Slurm runs them as one heterogeneous job (or one node when ``colocated``).
    ``resources`` (component name -> Resources fields) replaces the defaults: a job started with
    plain sbatch recorded what it was given, and its retry asks for the same."""
    given = resources or {}
    train = Resources(**{"gpus": max(train_gpus, 1), "cpus": 8, "mem_gb": 40, "time": "24:00:00",
                         **given.get(RL_TRAINING, {})})
    rollout = Resources(**{"gpus": max(rollout_gpus, 1), "cpus": 8, "mem_gb": 40, "time": "24:00:00",
                           **given.get(RL_ROLLOUT, {})})
    return JobSpec(name="rl", stage="rl", job="rl", job_args=list(job_args), inputs=[], outputs=outputs,
                   resources=Resources(gpus=train.gpus, cpus=2, mem_gb=48, time="24:00:00"),
                   components=[Component(RL_TRAINING, 1, train),
                               Component(RL_ROLLOUT, max(rollout_servers, 1), rollout)],
                   colocated=colocated)


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in a command line (``--flag V`` or ``--flag=V``), None when absent."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


@dataclass(frozen=True)
class RLProcesses:
    """The RL job's components as processes of one host (what ``sbatch/rl_common.sh`` does with
    ``srun`` on Slurm): one rollout server per rollout task, then the trainer, pointed at them."""

    servers: list[list[str]]  # python argv of each rollout server, index i writes address i
    address: str  # the servers' address file ({index}: the server's index when there are several)
    trainer_args: list[str]  # the job's args plus what points the trainer at the servers
    ready_timeout: float  # seconds for every server to answer its readiness check


def rl_processes(job: JobSpec, tag: str, *, device_per_server: bool = False) -> RLProcesses | None:
    """How a backend that starts processes runs ``job`` (an :func:`rl_job`) with its rollout
    component in processes of its own; None when the rollout runs inside the trainer: the engine
    is not the native one (vLLM runs in process), or the flags already name servers the user started.
    ``tag`` keeps one launch's address files apart from a previous one's; ``device_per_server``:
    each server sees only its own GPUs, so a ``cuda:K`` engine device becomes ``cuda``."""
    args = list(job.job_args)
    if (flag_value(args, "--engine") or "native") != "native" or flag_value(args, "--engine-address-file"):
        return None
    out = flag_value(args, "--output")
    if out is None:
        raise StageError("the RL job has no --output: its rollout servers' address files go there")
    n = job.parts[1].tasks
    address = f"{out}/engine/address-{tag}" + ("-{index}" if n > 1 else "") + ".json"
    device = flag_value(args, "--engine-device") or flag_value(args, "--device") or "cpu"
    if device_per_server and device.startswith("cuda"):
        device = "cuda"
    servers = [["-m", "hobson.jobs.rollout_server", "--address-file", address, "--index", str(i), "--device", device,
                "--bind", "127.0.0.1", "--advertise", "127.0.0.1"] for i in range(n)]
    trainer = [*args, "--engine-address-file", address]
    if n > 1 and flag_value(args, "--rollout-servers") is None:
        trainer += ["--rollout-servers", str(n)]
    return RLProcesses(servers, address, trainer, float(flag_value(args, "--engine-ready-timeout") or 600))
