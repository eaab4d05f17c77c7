"""One run on one EC2 host, kept in the local run directory: start, follow, status, logs, cancel, fetch.

This is the AWS room's own view of a run (the ``aws`` entry of ``run.json``, the host's record
mirrored from S3), used by ``python -m aws.runner`` and adapted to the launcher's Backend Protocol
by ``hobson.launch.backends.aws``; nothing here imports the launcher. The local run directory holds
``run.json`` with an ``aws`` entry (bucket, host, commands) from which ``status``, ``logs``,
``cancel`` and ``fetch`` re-attach. The host's own record is mirrored into it: ``stages.jsonl`` as
is, the host's ``run.json`` as ``host/run.json``, logs into the run's logs directory, and at the
end (or on ``fetch``) every output, so ``verify`` works on it.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from hobson.aws.clients import Clients
from hobson.aws.options import DEFAULT_AWS_CONFIG, AwsConfig
from hobson.aws.remote import RemoteRun, Runner, dry_run
from hobson.config import load_config
from hobson.errors import HobsonError
from hobson.records import REPO_ROOT, RunPaths, read_run_json, write_run_json


class AwsSession:
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
    def for_run(cls, paths: RunPaths, **kwargs) -> AwsSession:
        """The backend for an existing run, with the AWS config file it started with (if still there)."""
        recorded = (read_run_json(paths).get("aws") or {}).get("config")
        return cls(recorded if recorded and Path(recorded).exists() else None, **kwargs)

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

    def dry_run(self, argv_for_remote: list[str], paths: RunPaths) -> str:
        """Every AWS call and the host command the run would make; calls nothing."""
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
        host_meta = json.loads(host_json.read_text())
        meta = read_run_json(paths)
        meta["submissions"] = host_meta.get("submissions", [])
        meta["aws"]["host_versions"] = host_meta.get("versions")
        if state.get("exit") is not None:
            meta["aws"]["exit"] = state["exit"]
        write_run_json(paths, meta)
