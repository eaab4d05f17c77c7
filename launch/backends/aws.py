"""The aws backend: one EC2 host driven over SSM, running the local backend there.

The launcher calls this class; the work is in ``hobson.aws.runner`` (boto3). The local run directory
holds the launcher's ``run.json`` with an ``aws`` entry (bucket, host, commands) from which
``status``, ``logs``, ``cancel`` and ``fetch`` re-attach. The host's own record is mirrored
into it: ``stages.jsonl`` as is, the host's ``run.json`` as ``host/run.json``, logs into the
run's logs directory, and at the end (or on ``fetch``) every output, so ``verify`` works on it.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from hobson.aws.clients import Clients
from hobson.aws.options import DEFAULT_AWS_CONFIG, AwsConfig
from hobson.aws.runner import RemoteRun, Runner, dry_run
from hobson.config import load_config
from hobson.errors import HobsonError
from hobson.launch.backends.base import BackendOptions, Launch, Poll
from hobson.records import REPO_ROOT, RunPaths, read_run_json, write_run_json


class AwsBackend:
    name = "aws"

    def __init__(self, config: AwsConfig | str | os.PathLike | None = None, ngpu: int = 1, *,
                 clients: Clients | None = None, echo: Callable[[str], None] = print,
                 sleep: Callable[[float], None] = time.sleep, revision: str = "HEAD", allow_dirty: bool = False,
                 follow: bool = True, repo: Path = REPO_ROOT) -> None:
        self.config_path = None if isinstance(config, AwsConfig) else str(Path(config or DEFAULT_AWS_CONFIG).resolve())
        self.cfg = config if isinstance(config, AwsConfig) else load_config(self.config_path, AwsConfig)
        self.ngpu = max(ngpu, 1)
        self.revision, self.allow_dirty, self.follow, self.repo = revision, allow_dirty, follow, Path(repo)
        self.echo = echo
        self.runner = Runner(self.cfg, clients, repo=self.repo, echo=echo, sleep=sleep)

    @classmethod
    def from_options(cls, options: BackendOptions) -> AwsBackend:
        be = cls(options.aws_config if options.aws_config and Path(options.aws_config).exists() else None,
                 options.ngpu, allow_dirty=options.allow_dirty, follow=not options.detach)
        be.options = options
        return be

    @property
    def waits(self) -> bool:
        return self.follow  # detached: launch returns once the host started the run

    @property
    def options(self) -> BackendOptions:
        return getattr(self, "_options", None) or BackendOptions(
            ngpu=self.ngpu, aws_config=self.config_path, allow_dirty=self.allow_dirty, detach=not self.follow)

    @options.setter
    def options(self, value: BackendOptions) -> None:
        self._options = value

    # ----------------------------------------------------------------------------------------
    # the Backend interface (status, logs and cancel below read the record mirrored to S3)

    def launch(self, launch: Launch) -> int:
        meta = read_run_json(launch.paths)
        meta["host_argv"] = launch.host_argv()  # what retry reruns on a fresh host
        write_run_json(launch.paths, meta)
        return self.run(meta["host_argv"], launch.paths)

    def retry(self, launch: Launch) -> int:
        """A fresh host holds none of the finished outputs, so there is nothing to skip there: the
        run's recorded command runs again from the start, on a new host, into the same record."""
        argv = read_run_json(launch.paths).get("host_argv") or launch.host_argv()
        launch.echo("[aws] retry: a new host has none of the finished outputs; the whole run starts again there")
        return self.run(argv, launch.paths)

    def poll(self, meta: dict) -> Poll:
        return Poll("record")  # status() mirrored the host's record; it is the only source

    @classmethod
    def for_run(cls, paths: RunPaths, **kwargs) -> AwsBackend:
        """The backend for an existing run, with the AWS config file it started with (if still there)."""
        recorded = (read_run_json(paths).get("aws") or {}).get("config")
        return cls(recorded if recorded and Path(recorded).exists() else None, **kwargs)

    @staticmethod
    def available() -> int:
        return 1

    # ----------------------------------------------------------------------------------------
    def run(self, argv_for_remote: list[str], paths: RunPaths) -> int:
        """Start ``submit.py ARGV`` on a host; unless ``follow`` is off, follow it, fetch, release the host."""
        started: list[RemoteRun] = []

        def on_host(r: RemoteRun) -> None:
            r.config = self.config_path
            started[:] = [r]
            self._record(paths, r)

        try:
            remote = self.runner.start(argv_for_remote, paths.run_dir.name, self.ngpu, revision=self.revision,
                                       allow_dirty=self.allow_dirty, on_host=on_host)
        except BaseException:
            if started:  # a host launched for a run that never started is not left to its safety timer
                self.runner.release(started[0])
            raise
        if not self.follow:
            self.echo(f"[aws] detached; follow with: python launch/submit.py status {paths.run_dir}")
            return 0
        return self.finish(paths, remote)

    def finish(self, paths: RunPaths, remote: RemoteRun | None = None, *, interval: float | None = None,
               timeout_s: float | None = None) -> int:
        remote = remote or self._remote(paths)
        try:
            code = self.runner.follow(remote, paths.run_dir, paths.logs_dir, interval, timeout_s)
        except KeyboardInterrupt:
            self.echo(f"\n[aws] stopped following; the run goes on on {remote.instance_id}. Re-attach with: "
                      f"python launch/submit.py status {paths.run_dir} (fetch, logs, cancel likewise)")
            raise
        self.fetch(paths, remote)
        self.runner.release(remote)
        return code

    def status(self, paths: RunPaths) -> str:
        """Mirror the host's record into the run directory; one line saying where the run stands."""
        remote = self._remote(paths)
        state = self.runner.sync_records(remote, paths.run_dir, paths.logs_dir)
        self._merge_host_record(paths, state)
        where = f"{remote.instance_id} ({remote.instance_type}, {remote.region})"
        if state["exit"] is not None:
            e = state["exit"]
            return (f"aws run {remote.run_id} on {where}: ended, exit {e['exit_code']}"
                    + (" (cancelled)" if e.get("cancelled") else "") + f" at {e.get('ended_utc')}")
        if state["started"]:
            return f"aws run {remote.run_id} on {where}: running; mirror s3://{remote.bucket}/{remote.prefix}/"
        return f"aws run {remote.run_id} on {where}: not started yet (no mirror in s3://{remote.bucket}/{remote.prefix}/)"

    def logs(self, paths: RunPaths, job: str | None = None, task: int | None = None) -> str:
        """A job's log read from S3 (also saved under the run's logs dir); no job: the list."""
        remote = self._remote(paths)
        if job is None:
            names = [k[len("logs/"):] for k in self.runner._keys(remote) if k.startswith("logs/")]
            return "".join(f"{n}\n" for n in sorted(names))
        name = paths.log(job, task).name
        text = self.runner.log_text(remote, name)
        if text is None:
            have = [k[len("logs/"):] for k in self.runner._keys(remote) if k.startswith("logs/")]
            raise HobsonError(f"no log {name} in s3://{remote.bucket}/{remote.prefix}/logs/; logs there: "
                              + (", ".join(sorted(have)) or "none yet"))
        paths.logs_dir.mkdir(parents=True, exist_ok=True)
        (paths.logs_dir / name).write_text(text)
        return text

    def cancel(self, paths: RunPaths) -> str:
        remote = self._remote(paths)
        state = self.runner.sync_records(remote, paths.run_dir, paths.logs_dir)
        if state["exit"] is not None:
            return f"nothing to cancel: aws run {remote.run_id} already ended (exit {state['exit']['exit_code']})"
        res = self.runner.cancel(remote)
        self._record(paths, remote)
        if not res.ok:
            raise HobsonError(f"cancel failed: {res.describe()}")
        return f"cancel sent to {remote.instance_id}: {res.describe()}"

    def fetch(self, paths: RunPaths, remote: RemoteRun | None = None) -> list[Path]:
        remote = remote or self._remote(paths)
        files = self.runner.fetch(remote, paths.run_dir, paths.logs_dir)
        self._merge_host_record(paths, {"exit": None})
        return files

    def dry_run(self, launch: Launch | list[str], paths: RunPaths | None = None) -> str:
        argv_for_remote, paths = (launch.host_argv(), launch.paths) if isinstance(launch, Launch) else (launch, paths)
        buf = io.StringIO()
        dry_run(self.cfg, argv_for_remote, paths.run_dir.name, self.ngpu, repo=self.repo, revision=self.revision,
                allow_dirty=self.allow_dirty, out=lambda s: buf.write(s + "\n"))
        return buf.getvalue().rstrip("\n")

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def _record(paths: RunPaths, remote: RemoteRun) -> None:
        meta = read_run_json(paths)
        meta["aws"] = asdict(remote)
        write_run_json(paths, meta)

    @staticmethod
    def _remote(paths: RunPaths) -> RemoteRun:
        meta = read_run_json(paths)
        if "aws" not in meta:
            raise HobsonError(f"{paths.run_json} has no aws entry: this run did not start on AWS "
                              f"(backend {meta.get('backend')})")
        return RemoteRun.from_dict(meta["aws"])

    @staticmethod
    def _merge_host_record(paths: RunPaths, state: dict) -> None:
        """The host's submissions (which jobs ran) go into the local run.json, so `status` lists them."""
        host_json = paths.run_dir / "host" / "run.json"
        if not host_json.exists():
            return
        import json

        host_meta = json.loads(host_json.read_text())
        meta = read_run_json(paths)
        meta["submissions"] = host_meta.get("submissions", [])
        meta["aws"]["host_versions"] = host_meta.get("versions")
        if state.get("exit") is not None:
            meta["aws"]["exit"] = state["exit"]
        write_run_json(paths, meta)
