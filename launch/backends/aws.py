"""The aws backend: one EC2 host driven over SSM, running the local backend there.

The AWS room (``hobson.aws``) owns the run: :class:`hobson.aws.session.AwsSession` starts it,
follows it, and reads its status, logs and cancel from the record mirrored to S3. This class only
adapts that session to the launcher's Backend Protocol (options, launch, retry, poll, dry-run of a
:class:`Launch`); the AWS room never imports the launcher.
"""

from __future__ import annotations

from pathlib import Path

from hobson.aws.session import AwsSession
from hobson.launch.backends.base import BackendOptions, Launch, Poll, component_states
from hobson.records import RunPaths, read_run_json, write_run_json


class AwsBackend(AwsSession):
    """The session's status/logs/cancel are the Protocol's; launch and retry run the recorded
    host command through it."""

    name = "aws"

    @classmethod
    def from_options(cls, options: BackendOptions) -> AwsBackend:
        be = cls(options.aws_config if options.aws_config and Path(options.aws_config).exists() else None,
                 options.ngpu, allow_dirty=options.allow_dirty, follow=not options.detach)
        be.options = options
        return be

    remote = True  # the EC2 host

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

    @staticmethod
    def available() -> int:
        return 1

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
        # status() mirrored the host's record; it is the only source (an RL run's components included)
        return Poll("record", component_states(meta))

    def dry_run(self, launch: Launch | list[str], paths: RunPaths | None = None) -> str:
        if isinstance(launch, Launch):
            return super().dry_run(launch.host_argv(), launch.paths)
        return super().dry_run(launch, paths)
