"""A run's state as one table, from its record plus (on Slurm) one scheduler poll.

The run record says what finished (rows, sha256, wall time); the scheduler says what is
queued, running, failed or cancelled. On Slurm, one ``sacct`` call covers every job and
array task of the run; without accounting, ``squeue``; without either, the record alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from hobson.launch.backends.base import Backend, Poll
from hobson.records import RunPaths, latest_records, read_run_json, read_stage_records
from hobson.shards import parse_spec


@dataclass
class Row:
    job: str
    job_id: str
    shard: str
    state: str
    wall: str
    node: str
    exit: str
    rows: str
    sha256: str
    path: str


def _latest_submissions(meta: dict) -> dict[str, list[dict]]:
    """Per job name, the submissions of its latest attempt (an array split in parts has several)."""
    out: dict[str, list[dict]] = {}
    for sub in meta.get("submissions", []):
        prev = out.get(sub["job"])
        if prev and prev[-1].get("attempt") == sub.get("attempt"):
            prev.append(sub)
        else:
            out[sub["job"]] = [sub]
    return out


def collect(paths: RunPaths, backend: Backend) -> tuple[Poll, list[Row]]:
    meta = read_run_json(paths)
    latest = latest_records(read_stage_records(paths))
    poll = backend.poll(meta)
    sched = poll.states
    rows: list[Row] = []
    for name, subs in _latest_submissions(meta).items():
        # (shown name, job id, shard, scheduler key, record name)
        units: list[tuple[str, str, int | None, str, str | None]] = []
        if any("shards" in sub for sub in subs):
            # an array: every shard, each from the latest attempt that ran it (a retry reruns only
            # some; the others still show, finished)
            by_shard: dict[int, tuple[str, str, int | None, str, str | None]] = {}
            for sub in meta.get("submissions", []):
                if sub["job"] == name and "shards" in sub:
                    jid = sub.get("job_id", "-")
                    for k, shard in enumerate(parse_spec(sub["shards"])):
                        by_shard[shard] = (name, jid, shard, f"{jid}_{k}", name)
            units = [by_shard[shard] for shard in sorted(by_shard)]
            subs = []
        for sub in subs:
            jid = sub.get("job_id", "-")
            if sub.get("components") and not sub.get("colocated"):
                # one heterogeneous job: component k is <id>+k (Slurm) or its processes' pids (local);
                # the first one's process records the job
                ids = sub.get("component_ids") or [f"{jid}+{k}" for k in range(len(sub["components"]))]
                for k, comp in enumerate(sub["components"]):
                    units.append((f"{name} {comp}", ids[k], None, ids[k], name if k == 0 else None))
            else:
                units.append((name, jid, None, jid, name))
        for shown, jid, shard, key, rec_name in units:
            rec = latest.get((rec_name, shard)) if rec_name else None
            st = sched.get(key) or _pending_array_row(sched, jid)
            if st and st["state"] not in ("COMPLETED",):
                state = st["state"]
            elif rec:
                state = rec["status"]
            elif st:
                state = st["state"]
            else:
                state = poll.unrecorded
            outs = (rec or {}).get("outputs") or [{}]
            first = outs[0]
            wall = f"{rec['wall_s']:.1f}s" if rec and rec.get("wall_s") is not None else (st or {}).get("elapsed", "-")
            rows.append(Row(
                job=shown, job_id=jid or "-", shard="-" if shard is None else str(shard), state=state,
                wall=wall or "-", node=(st or {}).get("node") or (rec or {}).get("host") or "-",
                exit=str((rec or {}).get("exit_code", (st or {}).get("exit", "-"))),
                rows="-" if first.get("rows") is None else str(first["rows"]),
                sha256=(first.get("sha256") or "-")[:12],
                path=first.get("path") or (rec or {}).get("error", "")[:60],
            ))
            for o in outs[1:]:
                rows.append(Row(job="", job_id="", shard="", state="", wall="", node="", exit="",
                                rows="-" if o.get("rows") is None else str(o["rows"]),
                                sha256=(o.get("sha256") or "-")[:12], path=o.get("path", "")))
    return poll, rows


def _pending_array_row(sched: dict, jid: str) -> dict | None:
    # sacct shows a wholly pending array as one row "123_[0-7%8]"
    for key, val in sched.items():
        if key.startswith(f"{jid}_["):
            return val
    return None


def render(paths: RunPaths, backend: Backend, all_shards: bool = False) -> str:
    meta = read_run_json(paths)
    poll, rows = collect(paths, backend)
    source = poll.source
    git = meta.get("git", {})
    lines = [f"run {meta['run_id']}  backend {meta['backend']}  created {meta['created_utc']}  "
             f"git {(git.get('revision') or '-')[:12]}{' (dirty)' if git.get('dirty') else ''}  state from {source}"]
    header = Row("stage", "job id", "shard", "state", "wall", "node", "exit", "rows", "sha256", "output")
    shown = rows
    by_job: dict[str, list[Row]] = {}
    for r in rows:
        if r.job:
            by_job.setdefault(r.job, []).append(r)
    if not all_shards:
        shown = []
        for r in rows:
            if not r.job or len(by_job[r.job]) <= 16 or r.state != "ok":
                shown.append(r)
    fields = list(Row.__dataclass_fields__)
    widths = [max(len(getattr(x, f)) for x in [header, *shown]) for f in fields]
    for r in [header, *shown]:
        lines.append("  ".join(getattr(r, f).ljust(w) for f, w in zip(fields, widths, strict=True)).rstrip())
    for job, rs in by_job.items():
        if len(rs) > 16 and not all_shards:
            ok = sum(r.state == "ok" for r in rs)
            lines.append(f"{job}: {ok}/{len(rs)} shards ok (status --shards lists them all)")
    failed = [f"{r.job} shard {r.shard}" if r.shard != "-" else r.job for r in rows
              if r.state.lower() in ("failed", "cancelled", "timeout", "out_of_memory", "node_fail")]
    if failed:
        lines.append("failed or cancelled: " + ", ".join(failed))
    if poll.note:
        lines.append(poll.note)
    return "\n".join(lines)
