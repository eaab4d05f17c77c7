"""The local backend: subprocesses on this machine, one per array task, at most ``ngpu`` at once.

Jobs run in DAG order in the foreground. Array tasks share the GPU slots ``0..ngpu-1``: each
task gets ``CUDA_VISIBLE_DEVICES`` set to its slot (harmless on CPU, where slots only bound
the parallelism). A failed job stops the plan; its dependents never start. ``cancel`` from
another shell sends SIGTERM to this process, which stops its children and records them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from hobson.errors import StageError
from hobson.launch.backends.base import (
    BackendOptions,
    Launch,
    Poll,
    failure_report,
    job_environ,
    job_progress,
    local_logs,
)
from hobson.launch.dag import JobSpec
from hobson.lifetime import die_with_parent
from hobson.records import REPO_ROOT, RunPaths, append_stage_record, read_run_json, utc_now, write_run_json
from hobson.shards import format_spec


@dataclass
class _Task:
    proc: subprocess.Popen
    task: int | None
    shard: int | None
    slots: list[int]
    log: object
    started: float


class LocalBackend:
    name = "local"
    waits = True
    remote = False

    def __init__(self, ngpu: int, options: BackendOptions | None = None) -> None:
        self.ngpu = max(ngpu, 1)
        self.options = options or BackendOptions(ngpu=ngpu)
        self._running: list[_Task] = []
        self._cancelled = False

    @classmethod
    def from_options(cls, options: BackendOptions) -> LocalBackend:
        return cls(options.ngpu, options)

    @staticmethod
    def available() -> int:
        return 1

    # ----------------------------------------------------------------------------------------
    # the Backend interface

    def dry_run(self, launch: Launch) -> str:
        lines = []
        for j in launch.jobs:
            arr = f" [array {len(j.shards)} tasks, {j.throttle} at once]" if j.is_array else ""
            if j.heterogeneous:  # here the first component's process runs the others' work in process
                arr = (" [components " + ", ".join(f"{c.name} ({c.tasks} task{'s' * (c.tasks > 1)})" for c in j.parts)
                       + f"; here one process: {j.parts[0].name}, the rest inside it]")
            lines.append(f"# {j.name}{arr} after: {', '.join(j.after) or '-'}\n{j.command(str(launch.paths.run_dir))}")
        return "\n".join(lines)

    def launch(self, launch: Launch) -> int:
        return self.run(launch.jobs, launch.paths, launch.echo)

    def retry(self, launch: Launch) -> int:
        return self.run(launch.jobs, launch.paths, launch.echo)  # finished work is skipped by digest

    def status(self, paths: RunPaths) -> str:
        return ""  # the record says it all: the launcher and its tasks write it

    def logs(self, paths: RunPaths, job: str | None = None, task: int | None = None) -> str:
        return local_logs(paths, job, task)

    def poll(self, meta: dict) -> Poll:
        alive = self.launcher_alive(meta)
        local = meta.get("local") or {}
        note = None
        if not alive and local.get("pid") and not local.get("ended_utc") and local.get("host") == os.uname().nodename:
            note = (f"launcher pid {local['pid']} on {local['host']} (started {local.get('started_utc')}) is gone "
                    "without recording its end (killed?); its stages ended with it. `retry` continues the run")
        return Poll("record", {}, "running" if alive else "not run", note)

    # ----------------------------------------------------------------------------------------
    def run(self, jobs: list[JobSpec], paths: RunPaths, echo=print) -> int:
        """Run ``jobs`` to completion (skipping finished work); return 0, or the failing exit code."""
        meta = read_run_json(paths)
        meta["local"] = {"pid": os.getpid(), "pgid": os.getpgid(0), "host": os.uname().nodename,
                         "started_utc": utc_now()}
        write_run_json(paths, meta)
        old = signal.signal(signal.SIGTERM, self._on_term)
        try:
            for job in jobs:
                code = self._run_job(job, paths, meta, echo)
                if code != 0:
                    return code
            return 0
        finally:
            signal.signal(signal.SIGTERM, old)
            meta = read_run_json(paths)
            meta["local"]["ended_utc"] = utc_now()
            write_run_json(paths, meta)

    def _on_term(self, signum, frame) -> None:
        self._cancelled = True
        for t in self._running:
            _kill_group(t.proc, signal.SIGTERM)

    def _run_job(self, job: JobSpec, paths: RunPaths, meta: dict, echo) -> int:
        progress = job_progress(job, paths)
        if progress.done:
            echo(f"[{job.name}] already done with matching digests: skipped")
            return 0
        shards = progress.pending_shards if job.is_array else None
        if job.is_array and shards != job.shards:
            echo(f"[{job.name}] {len(job.shards) - len(shards)} shards already done; running shards "
                 f"{format_spec(shards)}")
        sub = {"job": job.name, "backend": "local", "attempt": utc_now()}
        if shards is not None:
            sub.update(shards=format_spec(shards), tasks=len(shards))
        meta.setdefault("submissions", []).append(sub)
        write_run_json(paths, meta)

        todo = list(enumerate(shards)) if shards is not None else [(None, None)]
        width = (job.throttle or self.ngpu) if job.is_array else 1
        gpus_per = job.resources.gpus
        free = list(range(self.ngpu))
        failed: list[_Task] = []
        paths.logs_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        while (todo or self._running) and not self._cancelled:
            while todo and len(self._running) < width and len(free) >= gpus_per and not failed:
                task, shard = todo.pop(0)
                slots = [free.pop(0) for _ in range(gpus_per)]
                self._running.append(self._start(job, paths, task, shard, slots, shards))
            time.sleep(0.05)
            for t in list(self._running):
                if t.proc.poll() is None:
                    continue
                self._running.remove(t)
                free.extend(t.slots)
                free.sort()
                t.log.close()
                what = job.name if t.shard is None else f"{job.name} shard {t.shard}"
                if t.proc.returncode == 0:
                    echo(f"[{what}] ok in {time.monotonic() - t.started:.1f}s")
                else:
                    echo(f"[{what}] FAILED (exit {t.proc.returncode})")
                    failed.append(t)
            if failed:
                todo.clear()  # a failed task stops the plan; let running siblings finish
        if self._cancelled:
            self._record_cancelled(job, paths)
            echo(f"[{job.name}] cancelled")
            return 143
        if failed:
            logs = [paths.log(job.name, t.task) for t in failed]
            echo(failure_report(job, logs))
            return failed[0].proc.returncode or 1
        if job.is_array:
            echo(f"[{job.name}] {len(shards)} tasks done in {time.monotonic() - t0:.1f}s")
        return 0

    def _start(self, job: JobSpec, paths: RunPaths, task: int | None, shard: int | None, slots: list[int],
               shards: list[int] | None) -> _Task:
        env = job_environ(job, task=task, gpus=slots)
        argv = job.stagerun_args(str(paths.run_dir), shards)  # a retry: task k -> pending shards[k]
        log = open(paths.log(job.name, task), "ab")
        # its own session (the launcher signals its group); SIGTERM when the launcher dies, even by SIGKILL
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO_ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        return _Task(proc, task, shard, slots, log, time.monotonic())

    def _record_cancelled(self, job: JobSpec, paths: RunPaths) -> None:
        for t in self._running:
            try:
                t.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(t.proc, signal.SIGKILL)
                t.proc.wait()
            append_stage_record(paths, {"stage": job.name, "shard": t.shard, "task": t.task, "status": "cancelled",
                                        "exit_code": t.proc.returncode, "end_utc": utc_now()})
        self._running.clear()

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def cancel(paths: RunPaths) -> str:
        local = read_run_json(paths).get("local") or {}
        pid = local.get("pid")
        if not pid or local.get("ended_utc"):
            return "nothing to cancel: the run's local launcher is not running"
        if local.get("host") != os.uname().nodename:
            raise StageError(f"this run's launcher runs on {local.get('host')}; cancel it there")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return f"launcher pid {pid} already gone"
        return f"sent SIGTERM to the local launcher (pid {pid}); it stops its tasks and records them"

    @staticmethod
    def launcher_alive(meta: dict) -> bool:
        local = meta.get("local") or {}
        if not local.get("pid") or local.get("ended_utc") or local.get("host") != os.uname().nodename:
            return False
        try:
            os.kill(local["pid"], 0)
            return True
        except OSError:
            return False


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
