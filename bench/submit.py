"""Submitting `recipe all` to the local Slurm cluster: hobson's backend against a plain loop of sbatch calls.

    python bench/submit.py [--widths 8 512 10000] [--max-array 1001] [--sample 1000]

For each array width N (teacher and replay arrays each N tasks wide; 8 is `recipe all --ngpu 8`) it
times, against the real cluster of tests/cluster/up.sh:

- hobson: ``dag.plan`` + ``SlurmBackend.submit`` of the whole `recipe all` plan, every job held
  (``ClusterProfile(extra_sbatch=["--hold"])``, so nothing runs); the cluster's ``MaxArraySize``
  is lowered to ``--max-array`` for the whole bench, so wide arrays are split into several arrays;
- one ``status`` poll: ``launch.status.render`` (one sacct + one squeue call for the whole run);
- the run-record read (``read_run_json`` + ``read_stage_records``) right after submission, and
  again with a ``stages.jsonl`` holding one record per job and array task (2N + 13 lines, written
  by ``append_stage_record`` in the format stagerun writes), i.e. the record of a finished run;
- baseline: the same 2N + 13 jobs as a plain bash loop of ``sbatch --hold --wrap=true`` calls, one
  per job or array task, and a status baseline of one ``squeue -j <id>`` per job. A loop longer than
  ``--max-plain`` calls is timed over its first ``--sample`` calls and extrapolated linearly (marked
  "extrapolated" in the table): 20,013 sbatch calls would take minutes on this machine.

Submission times exclude creating run.json (git and package versions) and importing submitit,
which a CLI invocation pays once whatever the width.

Every job it submits is cancelled (in a ``finally``) and it waits until slurmctld holds none of them
pending; ``MaxArraySize`` is restored to 10001 at the end, also on failure. Only this bench's job
ids are cancelled: other sessions may share the cluster. It restarts slurmctld twice (up.sh does
that to change MaxArraySize); jobs survive a restart. Run dirs and logs live in a temp dir.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import best_ms

from hobson.launch import dag, status
from hobson.launch.backends.base import scrubbed_environ
from hobson.launch.backends.slurm import SlurmBackend, max_array_size
from hobson.launch.options import ClusterProfile, RecipeConfig
from hobson.records import (
    RunPaths,
    append_stage_record,
    new_run_json,
    read_run_json,
    read_stage_records,
    write_run_json,
)

REPO = Path(__file__).resolve().parents[1]

UP = REPO / "tests" / "cluster" / "up.sh"
DEFAULT_MAX_ARRAY = 10001  # up.sh's default
NGPU = 8
SINGLE_JOBS = 13  # `recipe all` = 13 single jobs + the teacher and replay arrays
PLAIN_NAME = "hobson-bench-plain"


def slurm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, env=scrubbed_environ(), timeout=120, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args[:4])} ...` exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return r


def cluster_up(max_array: int) -> str:
    """up.sh with MaxArraySize = max_array (it restarts slurmctld when the value changes)."""
    env = {**scrubbed_environ(), "HOBSON_CLUSTER_MAX_ARRAY": str(max_array)}
    r = subprocess.run(["bash", str(UP)], capture_output=True, text=True, env=env, timeout=300, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"up.sh (MaxArraySize={max_array}) exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr}")
    got = max_array_size()
    if got != max_array:
        raise RuntimeError(f"after up.sh, scontrol show config says MaxArraySize={got}, not {max_array}")
    return r.stdout.strip().splitlines()[-1]


def chunks(ids: list[str], n: int = 1000) -> list[list[str]]:
    return [ids[i: i + n] for i in range(0, len(ids), n)]


def cancel(ids: list[str]) -> None:
    for part in chunks(ids):
        slurm("scancel", *part, check=False)


def wait_not_pending(ids: list[str], deadline_s: float = 120) -> None:
    """Until slurmctld holds none of ``ids`` pending (cancelled records stay visible for MinJobAge)."""
    end = time.monotonic() + deadline_s
    while True:
        left = []
        for part in chunks(ids):
            r = slurm("squeue", "-h", "-t", "pending,running", "-o", "%i", "-j", ",".join(part), check=False)
            left += r.stdout.split()
        if not left:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"{len(left)} bench jobs still pending/running {deadline_s:.0f} s after scancel: "
                               + " ".join(left[:10]))
        cancel(sorted({i.split("_")[0] for i in left}))
        time.sleep(0.5)


@dataclass
class Row:
    width: int
    jobs: int = 0                # 2N + 13: what the plain loop submits
    sbatch_calls: int = 0        # hobson: single jobs + array parts
    arrays: int = 0              # array parts after splitting at MaxArraySize
    submit_s: float = math.nan
    plain_s: float = math.nan
    plain_calls: int = 0         # sbatch calls actually made (< jobs: extrapolated)
    status_s: float = math.nan
    squeue_s: float = math.nan
    squeue_calls: int = 0
    read_ms: float = math.nan    # run record right after submission
    read_full_ms: float = math.nan  # with one stage record per job and task
    status_rows: int = 0
    status_source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def plain_extrapolated(self) -> bool:
        return self.plain_calls < self.jobs


def read_record(paths: RunPaths) -> None:
    read_run_json(paths)
    read_stage_records(paths)


def fill_stage_records(paths: RunPaths, jobs: list[dag.JobSpec]) -> int:
    """One ``ok`` record per job and array task, as stagerun appends them when a run finishes."""
    n = 0
    for job in jobs:
        for shard in job.shards if job.is_array else [None]:
            outs = [o.split("=")[0].replace("{shard}", str(shard)) for o in job.outputs]
            append_stage_record(paths, {
                "stage": job.name, "shard": shard, "task": shard, "start_utc": "2026-01-01T00:00:00.000000Z",
                "end_utc": "2026-01-01T00:01:00.000000Z", "wall_s": 60.0, "gpus": job.resources.gpus,
                "cpus": job.resources.cpus, "exit_code": 0, "host": "n1", "job_id": "1", "pid": 1,
                "outputs": [{"expected_rows": None, "ok": True, "path": o, "rows": 150, "sha256": "0" * 64}
                            for o in outs],
                "status": "ok", "world_size": 1,
            })
            n += 1
    return n


def submitted_ids(paths: RunPaths) -> list[str]:
    try:
        return SlurmBackend.job_ids(read_run_json(paths))
    except (OSError, ValueError):
        return []


def bench_hobson(row: Row, root: Path, mine: list[str]) -> None:
    cfg = RecipeConfig()
    cfg.teacher.shards = row.width
    cfg.decider.replay_shards = row.width
    paths = RunPaths.create(root / f"w{row.width}", root / "logs")
    paths.run_dir.mkdir(parents=True)
    write_run_json(paths, new_run_json(paths, argv=["bench/submit.py", str(row.width)], backend="slurm",
                                       options={"stages": ["all"], "ngpu": NGPU}, config_digests={}))
    ctx = dag.PlanContext(run_dir=str(paths.run_dir), ngpu=NGPU, config=cfg, seed=0, expected_rows=lambda rel: None)
    backend = SlurmBackend(ClusterProfile(extra_sbatch=["--hold"]), ngpu=NGPU)
    try:
        t = time.perf_counter()
        jobs = dag.plan(["all"], ctx, lambda rel: None)
        backend.submit(jobs, paths, echo=lambda s: None)
        row.submit_s = time.perf_counter() - t
    finally:
        mine += submitted_ids(paths)  # also what a failed submission left queued
    subs = read_run_json(paths)["submissions"]
    row.sbatch_calls = len(subs)
    row.arrays = sum("shards" in s for s in subs)
    row.jobs = sum(len(j.shards) if j.is_array else 1 for j in jobs)

    t = time.perf_counter()
    text = status.render(paths)
    row.status_s = time.perf_counter() - t
    row.status_source = text.splitlines()[0].rsplit("state from ", 1)[-1]
    row.status_rows = sum(" PENDING " in line for line in text.splitlines())
    if row.status_rows != row.jobs:
        row.notes.append(f"status showed {row.status_rows} PENDING rows of {row.jobs}")

    row.read_ms = best_ms(lambda: read_record(paths))
    fill_stage_records(paths, jobs)
    row.read_full_ms = best_ms(lambda: read_record(paths))


def bench_plain(row: Row, root: Path, mine: list[str], max_plain: int, sample: int) -> None:
    """The same jobs as one sbatch call each, then one squeue call per job: plain bash loops."""
    n = row.jobs if row.jobs <= max_plain else sample
    ids_file = root / f"plain-{row.width}.ids"
    loop = (f"for i in $(seq 1 {n}); do sbatch --hold --parsable --output=/dev/null --job-name={PLAIN_NAME} "
            f"--wrap=true >>{ids_file} || exit 1; done")
    t = time.perf_counter()
    r = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, env=scrubbed_environ(), check=False)
    elapsed = time.perf_counter() - t
    ids = [line.split(";")[0] for line in ids_file.read_text().split()] if ids_file.exists() else []
    mine += ids
    if r.returncode != 0 or len(ids) != n:
        raise RuntimeError(f"plain sbatch loop stopped after {len(ids)} of {n} calls: {r.stderr.strip()[-500:]}")
    row.plain_calls = n
    row.plain_s = elapsed * row.jobs / n

    # status baseline: one squeue per job (as many as were submitted; extrapolated like the loop)
    loop = f"for id in $(cat {ids_file}); do squeue -h -j ${{id%%;*}} >/dev/null || exit 1; done"
    t = time.perf_counter()
    r = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, env=scrubbed_environ(), check=False)
    elapsed = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"squeue loop failed: {r.stderr.strip()[-500:]}")
    row.squeue_calls = n
    row.squeue_s = elapsed * row.jobs / n


def fmt_s(v: float, extrapolated: bool = False) -> str:
    return f"{v:.2f}" + (" (extrapolated)" if extrapolated else "")


def table(rows: list[Row], max_array: int) -> str:
    head = ["width N", "jobs 2N+13", "hobson sbatch calls (arrays after split)", "hobson submit s",
            "plain sbatch loop s", "ratio", "status poll s (sacct+squeue)", "squeue -j loop s", "ratio",
            "record read ms (submitted / 2N+13 stage records)"]
    body = []
    for r in rows:
        ext = r.plain_extrapolated
        body.append([
            f"{r.width:,}", f"{r.jobs:,}", f"{r.sbatch_calls} ({r.arrays})", fmt_s(r.submit_s), fmt_s(r.plain_s, ext),
            f"{r.plain_s / r.submit_s:.1f}x", fmt_s(r.status_s), fmt_s(r.squeue_s, ext),
            f"{r.squeue_s / r.status_s:.1f}x", f"{r.read_ms:.2f} / {r.read_full_ms:.1f}",
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    out = [f"recipe all, --ngpu {NGPU}, held jobs, MaxArraySize={max_array} (lowered for the bench)",
           line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)]
    for r in rows:
        if r.plain_extrapolated:
            out.append(f"extrapolated (N={r.width:,}): first {r.plain_calls:,} sbatch calls took "
                       f"{1000 * r.plain_s / r.jobs:.1f} ms each and {r.squeue_calls:,} squeue calls "
                       f"{1000 * r.squeue_s / r.jobs:.1f} ms each, times {r.jobs:,} jobs")
        for n in r.notes:
            out.append(f"note (N={r.width:,}): {n}")
    return "\n".join(out)


def growth(rows: list[Row]) -> str:
    a, b = rows[0], rows[-1]
    k = b.jobs / a.jobs
    per_call = [1000 * r.submit_s / r.sbatch_calls for r in rows]
    return (f"growth from N={a.width:,} to N={b.width:,} (jobs x{k:.0f}): hobson submit x{b.submit_s / a.submit_s:.1f} "
            f"(it makes {a.sbatch_calls} -> {b.sbatch_calls} sbatch calls, one per job or array part: "
            + ", ".join(f"{p:.0f}" for p in per_call) + " ms per call); "
            f"plain loop x{b.plain_s / a.plain_s:.0f} (linear in 2N+13); "
            f"status poll x{b.status_s / a.status_s:.1f} (always 2 scheduler calls; "
            f"{1e6 * b.status_s / b.jobs:.0f} us per task at N={b.width:,}); "
            f"squeue loop x{b.squeue_s / a.squeue_s:.0f} (linear); "
            f"record read x{b.read_ms / a.read_ms:.1f} after submission, "
            f"x{b.read_full_ms / a.read_full_ms:.0f} with one stage record per task (linear in lines)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[8, 512, 10_000],
                   help="teacher and replay array widths (default 8 512 10000; 8 = `recipe all --ngpu 8`)")
    p.add_argument("--max-array", type=int, default=1001,
                   help="MaxArraySize the cluster is lowered to during the bench (default 1001)")
    p.add_argument("--max-plain", type=int, default=2000,
                   help="plain loops of more calls are timed over --sample calls and extrapolated (default 2000)")
    p.add_argument("--sample", type=int, default=1000, help="calls timed when extrapolating (default 1000)")
    args = p.parse_args(argv)

    rows: list[Row] = []
    mine: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hobson-bench-submit.") as d:
        root = Path(d)
        try:
            print(f"up.sh: {cluster_up(args.max_array)}", flush=True)
            warm = slurm("sbatch", "--hold", "--parsable", "--output=/dev/null", f"--job-name={PLAIN_NAME}",
                         "--wrap=true").stdout.split(";")[0].strip()  # the restarted slurmctld's first answer
            mine.append(warm)
            import submitit  # noqa: F401  (imported once here so the first width's time does not carry it)
            for width in args.widths:
                row = Row(width)
                rows.append(row)
                start = len(mine)
                bench_hobson(row, root, mine)
                cancel(mine[start:])  # keep the queue small for the next measurement
                start = len(mine)
                bench_plain(row, root, mine, args.max_plain, args.sample)
                cancel(mine[start:])
                print(f"N={width:,}: submit {row.submit_s:.2f} s, plain {row.plain_s:.2f} s, status "
                      f"{row.status_s:.2f} s, squeue loop {row.squeue_s:.2f} s ({time.monotonic() - t0:.0f} s in)",
                      flush=True)
        finally:
            if mine:
                cancel(mine)
                wait_not_pending(mine)
            print(f"cancelled the bench's {len(mine):,} job ids; none pending", flush=True)
            print(f"up.sh: {cluster_up(DEFAULT_MAX_ARRAY)}", flush=True)
    print()
    print(table(rows, args.max_array))
    print(growth(rows))
    print(f"bench wall time {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
