"""The local backend: subprocesses on this machine, one per array task, at most ``ngpu`` at once.

Jobs run in DAG order in the foreground. Array tasks share the GPU slots ``0..ngpu-1``: each
task gets ``CUDA_VISIBLE_DEVICES`` set to its slot (harmless on CPU, where slots only bound
the parallelism). A failed job stops the plan; its dependents never start. ``cancel`` from
another shell sends SIGTERM to this process, which stops its children and records them.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from hobson.errors import StageError
from hobson.launch.backends.base import (
    BackendOptions,
    Launch,
    Poll,
    component_states,
    failure_report,
    job_environ,
    job_progress,
    local_logs,
)
from hobson.launch.dag import JobSpec, RLProcesses, rl_processes
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
            plan = rl_processes(j, "local-<pid>", device_per_server=own_server_gpus(j)) if j.heterogeneous else None
            if j.heterogeneous and plan is None:  # vLLM, or servers the user started: the engine is the trainer's
                arr = (" [components " + ", ".join(f"{c.name} ({c.tasks} task{'s' * (c.tasks > 1)})" for c in j.parts)
                       + f"; here one process: {j.parts[0].name}, the rest inside it]")
            if plan is not None:
                comps = ", ".join(f"{c.name} ({c.tasks} process{'es' * (c.tasks > 1)})" for c in j.parts)
                lines.append(f"# {j.name} [components {comps}] after: {', '.join(j.after) or '-'}")
                lines += [f"# {j.parts[1].name} {i}, ready before training starts\n{shlex.join(['python', *argv])}"
                          for i, argv in enumerate(plan.servers)]
                trainer = replace(j, job_args=plan.trainer_args)
                lines.append(f"# {j.parts[0].name}\n{trainer.command(str(launch.paths.run_dir))}")
                continue
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
        return Poll("record", component_states(meta, alive), "running" if alive else "not run", note)

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
        if job.heterogeneous:
            plan = rl_processes(job, f"local-{os.getpid()}", device_per_server=own_server_gpus(job))
            if plan is not None:
                return _Components(self, job, paths, meta, plan, echo).run()
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


def _ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def host_gpus() -> int:
    """GPUs the NVIDIA driver shows on this host (0 without one); no CUDA initialised here."""
    root = "/proc/driver/nvidia/gpus"
    return len(os.listdir(root)) if os.path.isdir(root) else 0


def own_server_gpus(job: JobSpec) -> bool:
    """Whether each rollout server of ``job`` gets GPUs of its own here: not colocated, and the host
    has the training's plus every server's. Otherwise the servers share the training's GPUs (as
    ``--colocated`` does on Slurm), e.g. both on the one GPU of a workstation, or on CPU."""
    train, roll = job.parts[0], job.parts[1]
    return not job.colocated and host_gpus() >= train.resources.gpus + roll.tasks * roll.resources.gpus


class _Components:
    """A job of several components (the RL run) as processes of this host, the way
    ``sbatch/rl_common.sh`` runs it with ``srun`` on Slurm: the rollout servers first, each ready
    (its address file answers a ping, not a sleep), then the trainer pointed at them. When one
    component exits the others are stopped, and a failure names the component and its exit code.
    Every process gets SIGTERM when the launcher dies (even by SIGKILL): nothing is left behind."""

    def __init__(self, backend: LocalBackend, job: JobSpec, paths: RunPaths, meta: dict, plan: RLProcesses,
                 echo) -> None:
        self.b, self.job, self.paths, self.meta, self.plan, self.echo = backend, job, paths, meta, plan, echo
        self.train, self.roll = job.parts[0], job.parts[1]
        self.servers: list[subprocess.Popen] = []
        self.trainer: subprocess.Popen | None = None
        self.sub: dict = {}

    # -- naming, records ------------------------------------------------------------------------
    def _server_log(self, i: int):
        return self.paths.log(f"{self.job.name}-{self.roll.name}", i if len(self.plan.servers) > 1 else None)

    def _server_name(self, i: int) -> str:
        p = self.servers[i]
        return f"the {self.roll.name} component (server {i}, pid {p.pid}, log {self._server_log(i)})"

    def _record(self, training: str | None = None, rollout: str | None = None) -> None:
        states = self.sub["component_states"]
        states[0], states[1] = training or states[0], rollout or states[1]
        self.sub["component_ids"] = [str(self.trainer.pid) if self.trainer else "-",
                                     ",".join(str(p.pid) for p in self.servers) or "-"]
        write_run_json(self.paths, self.meta)

    def _fail(self, code: int, line: str, logs: list) -> int:
        code = 128 - code if code < 0 else code  # killed by signal N: exit 128+N, as a shell says it
        self.echo(f"[{self.job.name}] FAILED: {line}")
        self.echo(failure_report(self.job, logs))
        if self.trainer is None:  # the trainer (stagerun) records itself; a job that never got to it is recorded here
            append_stage_record(self.paths, {"stage": self.job.name, "shard": None, "task": None, "status": "failed",
                                             "exit_code": code, "error": line, "end_utc": utc_now()})
        return code or 1

    # -- processes --------------------------------------------------------------------------------
    def _popen(self, argv: list[str], log_path, slots: list[int]) -> subprocess.Popen:
        log = open(log_path, "ab")
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO_ROOT, env=job_environ(self.job, gpus=slots),
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        self.b._running.append(_Task(proc, None, None, slots, log, time.monotonic()))  # cancel reaches it
        return proc

    def _stop(self, procs: list[subprocess.Popen], grace: float = 10.0) -> None:
        for p in procs:
            if p.poll() is None:
                _kill_group(p, signal.SIGTERM)
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _kill_group(p, signal.SIGKILL)
                p.wait()

    def _answering(self) -> bool:
        """Do all servers answer a readiness request? (was the rollout the cause of a failure?)"""
        r = subprocess.run([sys.executable, "-m", "hobson.jobs.rollout_server", "--ping", "--address-file",
                            self.plan.address, "--servers", str(len(self.servers)), "--timeout", "10"],
                           cwd=REPO_ROOT, capture_output=True)
        return r.returncode == 0

    def _close(self, code: int) -> int:
        for t in self.b._running:
            t.log.close()
        self.b._running.clear()
        return code

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._close(self._run())
        except BaseException:
            self._stop([*self.servers, *([self.trainer] if self.trainer else [])], grace=2.0)
            self._close(1)
            raise

    def _run(self) -> int:
        job, paths, echo = self.job, self.paths, self.echo
        t0 = time.monotonic()
        train_slots = list(range(max(self.train.resources.gpus, 1)))
        own = own_server_gpus(job)
        per = self.roll.resources.gpus
        self.sub = {"job": job.name, "backend": "local", "attempt": utc_now(),
                    "components": [self.train.name, self.roll.name], "component_states": ["waiting", "starting"],
                    "component_ids": ["-", "-"], "host": os.uname().nodename}
        self.meta.setdefault("submissions", []).append(self.sub)
        paths.logs_dir.mkdir(parents=True, exist_ok=True)
        address = Path(REPO_ROOT) / self.plan.address  # the processes' working directory is the checkout
        for f in address.parent.glob(address.name.replace("{index}", "*")):
            f.unlink()  # a previous launch with the same pid must not be mistaken for this one's servers
        for i, argv in enumerate(self.plan.servers):
            slots = list(range(len(train_slots) + i * per, len(train_slots) + (i + 1) * per)) if own else train_slots
            self.servers.append(self._popen(argv, self._server_log(i), slots))
        self._record()
        echo(f"[{job.name}] {len(self.servers)} rollout server(s) starting (pids "
             f"{', '.join(str(p.pid) for p in self.servers)}; GPUs {'their own' if own else 'shared with training'})")

        waiter = subprocess.Popen(
            [sys.executable, "-m", "hobson.jobs.rollout_server", "--wait", "--address-file", self.plan.address,
             "--servers", str(len(self.servers)), "--timeout", str(self.plan.ready_timeout)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        while waiter.poll() is None and not self.b._cancelled:
            dead = [i for i, p in enumerate(self.servers) if p.poll() is not None]
            if dead:
                break
            time.sleep(0.05)
        dead = [i for i, p in enumerate(self.servers) if p.poll() is not None]
        if waiter.poll() is None:
            self._stop([waiter], grace=1.0)
        said = waiter.stdout.read().decode(errors="replace").strip() if waiter.stdout else ""
        if self.b._cancelled:
            return self._cancel()
        if dead or waiter.returncode != 0:
            i = dead[0] if dead else None
            self._stop(self.servers)
            self._record(training="not started", rollout="failed")
            if i is not None:
                line = (f"{self._server_name(i)} {_ended(self.servers[i].returncode)} before it was ready; "
                        "training was not started")
                return self._fail(self.servers[i].returncode, line, [self._server_log(i)])
            last = said.splitlines()[-1] if said else "no answer"
            line = (f"the {self.roll.name} component did not become ready within {self.plan.ready_timeout:g} s "
                    f"(--engine-ready-timeout): {last}; training was not started")
            return self._fail(1, line, [self._server_log(k) for k in range(len(self.servers))])
        for i, addr in enumerate(said.splitlines()):
            echo(f"[{job.name}] rollout server {i} ready: {addr}")

        trainer_job = replace(job, job_args=self.plan.trainer_args)
        self.trainer = self._popen(trainer_job.stagerun_args(str(paths.run_dir)), paths.log(job.name), train_slots)
        self._record(training="running", rollout="running")
        while True:
            if self.b._cancelled:
                return self._cancel()
            code = self.trainer.poll()
            dead = [i for i, p in enumerate(self.servers) if p.poll() is not None]
            if code is not None:
                return self._trainer_ended(code, t0)
            if dead:
                return self._server_ended(dead[0], t0)
            time.sleep(0.05)

    def _trainer_ended(self, code: int, t0: float) -> int:
        name = f"the {self.train.name} component (pid {self.trainer.pid}, log {self.paths.log(self.job.name)})"
        if code == 0:
            # its close() shut the servers down; give them a deadline all the same
            end = time.monotonic() + 30
            while any(p.poll() is None for p in self.servers) and time.monotonic() < end:
                time.sleep(0.05)
            self._stop(self.servers)
            self._record(training="ok", rollout="ok")
            self.echo(f"[{self.job.name}] ok in {time.monotonic() - t0:.1f}s")
            return 0
        gone = [i for i, p in enumerate(self.servers) if p.poll() is not None]
        if gone or not self._answering():
            who = self._server_name(gone[0]) if gone else f"the {self.roll.name} component"
            line = f"{who} is gone or not answering; {name} {_ended(code)}"
            self._stop(self.servers)
            self._record(training="failed", rollout="failed")
            return self._fail(code, line, [self.paths.log(self.job.name), *[self._server_log(i) for i in gone]])
        self._stop(self.servers)
        self._record(training="failed", rollout="stopped")
        return self._fail(code, f"{name} {_ended(code)}; stopped the {self.roll.name} component",
                          [self.paths.log(self.job.name)])

    def _server_ended(self, i: int, t0: float) -> int:
        code = self.servers[i].returncode
        if code == 0:  # fine only if the trainer then finishes: it shut the server down
            end = time.monotonic() + 60
            while self.trainer.poll() is None and time.monotonic() < end:
                time.sleep(0.05)
            if self.trainer.poll() is not None:
                return self._trainer_ended(self.trainer.returncode, t0)
        line = (f"{self._server_name(i)} {_ended(code)} while the {self.train.name} component was running; "
                "stopped training")
        self._stop([self.trainer, *self.servers])
        self._record(training="stopped", rollout="failed")
        return self._fail(code, line, [self._server_log(i), self.paths.log(self.job.name)])

    def _cancel(self) -> int:
        self._stop([*self.servers, *([self.trainer] if self.trainer else [])])
        self._record(training="cancelled" if self.trainer else "not started", rollout="cancelled")
        append_stage_record(self.paths, {"stage": self.job.name, "shard": None, "task": None, "status": "cancelled",
                                         "exit_code": self.trainer.returncode if self.trainer else None,
                                         "end_utc": utc_now()})
        self.echo(f"[{self.job.name}] cancelled")
        return 143
