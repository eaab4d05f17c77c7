"""Fixtures for tests that run against the project's local Slurm cluster (tests/cluster/up.sh).

Every test in this folder gets the `slurm` marker and needs the cluster: when it does not answer,
the tests are skipped, or fail when `HOBSON_REQUIRE_SLURM=1` (CI sets it, so a broken cluster can
never turn into a green run of skipped tests).

The `slurm_jobs` fixture submits jobs with the test's SLURM_*/SBATCH_* environment scrubbed (a
test run inside a Slurm allocation must not leak that allocation into the jobs it submits) and
waits for them with a deadline, polling sacct and squeue with a short backoff; at teardown it
cancels whatever a test left queued or running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
UP_HINT = "bring it up with `bash tests/cluster/up.sh` (as root; ~30 s the first time, ~1 s when up)"

# Variables Slurm sets inside an allocation or reads as option defaults. SLURM_CONF only says
# which cluster to talk to, so it stays.
SCRUB_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SACCT_", "PMIX_", "PMI_")
KEEP = frozenset({"SLURM_CONF"})

# sacct states after which a job record never changes again (sacct prints "CANCELLED by <uid>")
TERMINAL = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
})
CMD_TIMEOUT_S = 15.0   # a single Slurm client call; slurmctld answers in milliseconds when healthy


def scrubbed_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without the Slurm allocation variables (SLURM_CONF kept), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k in KEEP or not k.startswith(SCRUB_PREFIXES)}
    env.update(extra or {})
    return env


def run_slurm(args: Sequence[str], check: bool = True, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run one Slurm client command with the scrubbed environment and a timeout."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                          env=scrubbed_env(env), cwd=cwd)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


@dataclass(frozen=True)
class SlurmCluster:
    """What the session fixture found: node names and their `sinfo` state, accounting on/off."""

    nodes: dict[str, str]
    accounting: bool


def _probe_cluster() -> SlurmCluster | str:
    """The cluster, or a message saying why it is not usable."""
    for tool in ("sbatch", "scontrol", "sinfo", "squeue", "sacct", "scancel"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: no Slurm client installed"
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if not os.path.exists(conf):   # else the clients spend ~15 s looking for a configless server
        return f"no Slurm config at {conf}"
    try:
        ping = run_slurm(["scontrol", "ping"], check=False)
        if "is UP" not in ping.stdout:
            return f"slurmctld does not answer `scontrol ping`: {(ping.stdout + ping.stderr).strip()}"
        out = run_slurm(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
    except (subprocess.TimeoutExpired, RuntimeError) as e:
        return f"Slurm does not answer: {e}"
    nodes = dict(line.split() for line in sorted(set(out.splitlines())) if line.strip())
    # idle, or busy with someone else's jobs; a "*" suffix means slurmctld cannot reach the slurmd
    usable = [n for n, st in nodes.items() if st in ("idle", "mix", "alloc", "comp")]
    if not usable:
        return f"no node answering in `sinfo`: {nodes or 'no nodes'}"
    acct = run_slurm(["sacct", "-n", "-X", "-j", "1"], check=False).returncode == 0
    return SlurmCluster(nodes=nodes, accounting=acct)


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The local cluster; skips (fails under HOBSON_REQUIRE_SLURM=1) when it does not answer."""
    found = _probe_cluster()
    if isinstance(found, str):
        msg = f"local Slurm cluster not usable: {found}; {UP_HINT}"
        if os.environ.get("HOBSON_REQUIRE_SLURM") == "1":
            pytest.fail(f"HOBSON_REQUIRE_SLURM=1 and {msg}", pytrace=False)
        pytest.skip(msg)
    return found


@pytest.fixture(autouse=True)
def _slurm_test(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here needs the cluster and runs with the Slurm allocation variables removed."""
    for key in list(os.environ):
        if key not in KEEP and key.startswith(SCRUB_PREFIXES):
            monkeypatch.delenv(key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: mark only the ones collected from this folder.
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slurm)


class SlurmJobs:
    """Submit jobs and wait for them with deadlines; remembers ids so teardown can cancel them."""

    run = staticmethod(run_slurm)   # tests reach helpers through fixtures, never `import conftest`

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.submitted: list[str] = []

    def sbatch(self, *args: str, script: str | None = None, env: dict[str, str] | None = None) -> str:
        """`sbatch --parsable ARGS [script]` from the test's workdir; returns the job id.

        `script` is the text of a batch script (written to the workdir); without it pass `--wrap`.
        """
        cmd = ["sbatch", "--parsable", f"--chdir={self.workdir}", *args]
        if script is not None:
            path = self.workdir / f"job{len(self.submitted)}.sh"
            path.write_text(script)
            cmd.append(str(path))
        job_id = run_slurm(cmd, env=env, cwd=self.workdir).stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise RuntimeError(f"sbatch did not print a job id: {job_id!r}")
        self.submitted.append(job_id)
        return job_id

    def sacct(self, job_ids: Sequence[str], fields: Sequence[str] = ("JobID", "State", "ExitCode"),
              steps: bool = False, attempts: bool = False) -> list[dict[str, str]]:
        """sacct rows for the given jobs (one call). Always by -j: sacct's default time window
        leaves out jobs cancelled while pending (they have no eligible time). ``attempts``: every
        attempt of a requeued job, oldest first (-D), not only its last."""
        cmd = ["sacct", "-n", "-P", "-j", ",".join(job_ids), "-o", ",".join(fields)]
        if not steps:
            cmd.insert(1, "-X")
        if attempts:
            cmd.insert(1, "-D")
        out = run_slurm(cmd).stdout
        return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line]

    def active(self, job_ids: Sequence[str]) -> list[str]:
        """squeue lines (id state reason) of the jobs slurmctld still holds pending/running."""
        proc = run_slurm(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T %r"], check=False)
        return proc.stdout.splitlines() if proc.returncode == 0 else []   # purged ids: error

    def records(self, job_ids: Sequence[str]) -> dict[str, str]:
        """slurmctld's own view: every record (array task, het component) -> state, finished ones
        included for MinJobAge (600 s); {} once slurmctld has purged the jobs."""
        proc = run_slurm(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i %T"], check=False)
        return dict(line.split() for line in proc.stdout.splitlines()) if proc.returncode == 0 else {}

    def wait(self, *job_ids: str, deadline_s: float = 20.0,
             fields: Sequence[str] = ("JobID", "State", "ExitCode")) -> list[dict[str, str]]:
        """Wait until slurmctld is done with the jobs and sacct holds a final state for every record
        slurmctld knows (array task, het component); return those sacct rows, one call per poll.
        Accounting lags slurmctld: a finished array can show only some tasks in sacct for a moment.
        Fails the test at the deadline."""
        fields = tuple(dict.fromkeys(("JobID", "State", *fields)))
        end = time.monotonic() + deadline_s
        delay = 0.1
        while True:
            ctld = self.records(job_ids)
            rows = self.sacct(job_ids, fields)
            acct = {r["JobID"]: r["State"].split()[0] for r in rows}
            if rows and all(st in TERMINAL for st in acct.values()) and all(
                    st in TERMINAL and acct.get(rec) in TERMINAL for rec, st in ctld.items()):
                return rows
            if time.monotonic() > end:
                pytest.fail(f"jobs {','.join(job_ids)} not finished after {deadline_s:.0f} s; "
                            f"slurmctld: {ctld}; sacct: {acct}", pytrace=False)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def submit_and_wait(self, *args: str, script: str | None = None, deadline_s: float = 20.0,
                        fields: Sequence[str] = ("JobID", "State", "ExitCode")) -> list[dict[str, str]]:
        return self.wait(self.sbatch(*args, script=script), deadline_s=deadline_s, fields=fields)

    def cancel_leftovers(self) -> None:
        if self.submitted:
            run_slurm(["scancel", *self.submitted], check=False)


@pytest.fixture
def slurm_jobs(tmp_path: Path) -> Iterator[SlurmJobs]:
    """A SlurmJobs whose workdir is the test's tmp_path (job logs land there)."""
    jobs = SlurmJobs(tmp_path)
    yield jobs
    jobs.cancel_leftovers()


# ---------------------------------------------------------------------------------------------
# decider training for a few steps, shared by the multi-node and the training fault tests

TINY_STEPS = 3  # optimizer steps of the tiny training runs: 2 micro-batches of 16 rows each


@dataclass(frozen=True)
class TinyTraining:
    """`parent` and `train` for TINY_STEPS steps (``max_steps``) on the inputs of the session's
    `recipe all --backend local` run, and their final checkpoints from 1 node x 2 ranks and from
    one process. The configs checkpoint every step (a fault test resumes from one) and use one
    torch thread, as the Slurm jobs do; both are run control, so every run computes the same."""

    steps: int  # optimizer steps of each run
    inputs: Path  # the local run: read only
    configs: dict[str, Path]  # stage -> its training config
    two_ranks: dict[str, Path]  # stage -> final/ of 2 ranks on this machine
    one_process: dict[str, Path]  # stage -> final/ of one process

    def write_config(self, stage: str, dest: Path, **run_control: object) -> Path:
        """The stage's tiny config with more run-control keys (e.g. ``trace_dir``)."""
        import yaml

        cfg = yaml.safe_load(self.configs[stage].read_text())
        dest.write_text(yaml.safe_dump({**cfg, **run_control}, sort_keys=False))
        return dest

    def copy_inputs(self, dest: Path) -> Path:
        """A run directory holding the local run's inputs of `parent` and `train` (records included)
        but nothing of either stage or of those after it."""
        shutil.copytree(self.inputs, dest, ignore=shutil.ignore_patterns("parent", "train", "calibrated", "eval"))
        return dest


def tiny_job_args(stage: str, run_dir: Path, config: Path) -> list[str]:
    """`python -m jobs.train` arguments of ``stage`` exactly as the launcher plans them."""
    from hobson.launch import dag
    from hobson.launch.options import RecipeConfig

    cfg = RecipeConfig()
    cfg.decider.parent_config = cfg.decider.train_config = str(config)
    ctx = dag.PlanContext(run_dir=str(run_dir), ngpu=2, config=cfg, seed=0, expected_rows=lambda rel: None)
    (job,) = dag.BY_NAME[stage].jobs(ctx)
    return job.job_args


@pytest.fixture(scope="session")
def tiny_training(recipe_all_local: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory) -> TinyTraining:
    """Two ranks and one process, each forked from the forkserver of ``run_local_ranks`` (torch and
    transformers imported once): about 25 s for both stages on 2 cores."""
    import yaml

    from hobson.decider.train import run_local_ranks

    base = tmp_path_factory.mktemp("tiny-training")
    repo = HERE.parents[1]
    configs = {}
    for stage, shipped in (("parent", "configs/train-parent.yaml"), ("train", "configs/train.yaml")):
        cfg = yaml.safe_load((repo / shipped).read_text())
        cfg.update(max_steps=TINY_STEPS, checkpoint_every=1, num_threads=1)
        configs[stage] = base / f"{stage}.yaml"
        configs[stage].write_text(yaml.safe_dump(cfg, sort_keys=False))
    finals: dict[int, dict[str, Path]] = {2: {}, 1: {}}
    for world in (2, 1):
        for stage, config in configs.items():
            out = base / f"{stage}-{world}"
            args = tiny_job_args(stage, recipe_all_local[0], config)
            run_local_ranks(config, [*args[2:], f"output_dir={out}"], world, timeout_s=300)
            finals[world][stage] = out / "final"
    return TinyTraining(steps=TINY_STEPS, inputs=recipe_all_local[0], configs=configs, two_ranks=finals[2],
                        one_process=finals[1])
