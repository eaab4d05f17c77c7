"""A run on one EC2 GPU host driven over SSM: :class:`RemoteRun` (what re-attaches to it),
:class:`Runner` (infrastructure, host, code sync, commands, polling, fetch, teardown) and
:func:`dry_run`.

A run is started by one ``AWS-RunShellScript`` command (:func:`start_payload`) that fetches the
code archive from S3, checks its sha256, unpacks it into ``<home>/code/<run id>``, runs
``aws/host_setup.sh`` there (which installs that code into the host venv, editable), and starts
``python -m hobson.aws.hostrun ... -- launch/submit.py ARGV --backend local ...`` under ``nohup setsid``,
so the run outlives the command. The host mirrors its run record, logs and outputs to
``s3://<bucket>/runs/<run id>/``; ``status``, ``logs`` and ``fetch`` read them from there.
"""

from __future__ import annotations

import json
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from botocore.exceptions import ClientError

from hobson.aws import codesync, commands, host, infra
from hobson.aws.clients import Clients, error_code
from hobson.aws.options import AwsConfig
from hobson.errors import HobsonError
from hobson.io import atomic_write
from hobson.records import REPO_ROOT


@dataclass
class RemoteRun:
    """Everything needed to re-attach to a run on AWS; kept as ``run.json["aws"]`` locally."""

    run_id: str
    bucket: str
    bucket_region: str
    instance_id: str
    region: str
    instance_type: str
    launched: bool
    host_home: str
    argv: list[str]
    code: dict = field(default_factory=dict)  # the code manifest
    config: str | None = None  # the AWS config file the run started with (status/cancel reload it)
    commands: list[dict] = field(default_factory=list)  # every command sent: id, what, status, output

    @property
    def prefix(self) -> str:
        return f"runs/{self.run_id}"

    @property
    def host_run_dir(self) -> str:
        return f"{self.host_home}/runs/{self.run_id}"

    @classmethod
    def from_dict(cls, d: dict) -> RemoteRun:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# ---------------------------------------------------------------------------------------------
# what the host runs


def start_payload(cfg: AwsConfig, *, bucket: str, bucket_region: str, run_id: str, code_key: str,
                  code_sha256: str, argv: list[str]) -> list[str]:
    """The ``commands`` of the SSM command that starts a run: POSIX sh (the agent runs ``sh``).

    ``argv`` is any ``launch/submit.py`` argv (``recipe ...``, ``rl ...``); the host appends
    ``--backend local --run-dir <home>/runs/<id> --logs-dir <home>/logs``.
    """
    h = cfg.host
    q = shlex.quote
    setup = ["bash", "aws/host_setup.sh", "--home", h.home, "--python", h.python, "--extras", h.extras]
    if not h.venv:
        setup.append("--no-venv")
    if h.scratch_mount:
        setup += ["--scratch-mount", h.scratch_mount]
    for m in h.prefetch_models:
        setup += ["--prefetch", m]
    remote_argv = ["launch/submit.py", *argv, "--backend", "local", "--run-dir", f"{h.home}/runs/{run_id}",
                   "--logs-dir", f"{h.home}/logs"]
    hostrun = ["-m", "hobson.aws.hostrun", "--bucket", bucket, "--prefix", f"runs/{run_id}",
               "--run-dir", f"{h.home}/runs/{run_id}", "--logs-dir", f"{h.home}/logs/{run_id}",
               "--interval", str(cfg.mirror_interval_s), "--own-log", f"{h.home}/runs/{run_id}.hostrun.log",
               "--", *remote_argv]
    download = 'import boto3,sys; boto3.client("s3").download_file(sys.argv[1], sys.argv[2], sys.argv[3])'
    return [
        "set -eu",
        f"# hobson run {run_id}: fetch code, set up, start detached; the run mirrors itself to s3://{bucket}/runs/{run_id}/",
        f"export AWS_DEFAULT_REGION={q(bucket_region)}",
        f"HOBSON_HOME={q(h.home)}",
        f"RUN_ID={q(run_id)}",
        'PIDF="$HOBSON_HOME/runs/$RUN_ID.hostrun.pid"',
        'if [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; then '
        'echo "hobson: run $RUN_ID already running (pid $(cat "$PIDF"))"; exit 0; fi',
        'STAGE="${TMPDIR:-/tmp}/hobson-stage-$RUN_ID"',
        'rm -rf "$STAGE" && mkdir -p "$STAGE/code"',
        "if command -v aws >/dev/null 2>&1; then",
        f'  aws s3 cp --only-show-errors {q(f"s3://{bucket}/{code_key}")} "$STAGE/code.tar.gz"',
        "else",
        f'  {q(h.python)} -c {q(download)} {q(bucket)} {q(code_key)} "$STAGE/code.tar.gz"',
        "fi",
        f'echo "{code_sha256}  $STAGE/code.tar.gz" | sha256sum -c --quiet - '
        '|| { echo "hobson: code archive digest mismatch" >&2; exit 3; }',
        'tar -xzf "$STAGE/code.tar.gz" -C "$STAGE/code"',
        'CODE="$HOBSON_HOME/code/$RUN_ID"',
        'rm -rf "$CODE" && mkdir -p "$HOBSON_HOME/code" "$HOBSON_HOME/runs" && mv "$STAGE/code" "$CODE"',
        'rm -rf "$STAGE"',
        'cd "$CODE"',
        # set up from the code's final place: the venv's editable install of hobson points here
        shlex.join(setup),
        '. "$HOBSON_HOME/env.sh"',
        f'nohup setsid "$HOBSON_PYTHON" {shlex.join(hostrun)} '
        '> "$HOBSON_HOME/runs/$RUN_ID.hostrun.log" 2>&1 < /dev/null &',
        'echo $! > "$PIDF"',
        "sleep 2",
        'LOG="$HOBSON_HOME/runs/$RUN_ID.hostrun.log"',
        'if ! kill -0 "$(cat "$PIDF")" 2>/dev/null && ! grep -q "^\\[hostrun\\] run ended" "$LOG"; then '
        'echo "hobson: the run did not start; end of $LOG:" >&2; tail -n 40 "$LOG" >&2; exit 4; fi',
        f'echo "hobson: run $RUN_ID started on $(hostname) (pid $(cat "$PIDF")); mirror: s3://{bucket}/runs/$RUN_ID/"',
    ]


def cancel_payload(cfg: AwsConfig, run_id: str) -> list[str]:
    pidf = shlex.quote(f"{cfg.host.home}/runs/{run_id}.hostrun.pid")
    return [
        "set -eu",
        f"PID=$(cat {pidf} 2>/dev/null || true)",
        'if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then kill -TERM "$PID"; '
        f'echo "hobson: sent SIGTERM to run {run_id} (pid $PID); it records the cancellation and mirrors it"; '
        f'else echo "hobson: run {run_id} is not running on this host"; fi',
    ]


# ---------------------------------------------------------------------------------------------
# the runner


class Runner:
    def __init__(self, cfg: AwsConfig, clients: Clients | None = None, *, repo: Path = REPO_ROOT,
                 echo: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg
        self.clients = clients or Clients()
        self.repo = Path(repo)
        self.echo = echo
        self.sleep = sleep

    @property
    def tags(self) -> dict[str, str]:
        return {self.cfg.tag_key: self.cfg.tag_value}

    def bucket_name(self) -> str:
        if self.cfg.bucket:
            return self.cfg.bucket
        account = self.clients("sts", self.cfg.bucket_region).get_caller_identity()["Account"]
        return f"hobson-{account}-{self.cfg.bucket_region}"

    def ensure_infra(self) -> infra.Infra:
        cfg = self.cfg
        inf = infra.Infra(bucket=self.bucket_name(), bucket_region=cfg.bucket_region, instance_profile=cfg.role_name)
        infra.ensure_bucket(self.clients("s3", cfg.bucket_region), inf.bucket, cfg.bucket_region, self.tags,
                            inf.created)
        infra.ensure_role(self.clients("iam", cfg.bucket_region), cfg.role_name, inf.bucket, self.tags, inf.created)
        for line in inf.created:
            self.echo(f"[aws] created {line}")
        return inf

    def acquire_host(self, inf: infra.Infra, run_id: str, ngpu: int) -> host.Host:
        h = host.find_reusable(self.clients, self.cfg, ngpu) if self.cfg.reuse_host else None
        if h is not None:
            host.set_state(self.clients, h.region, h.instance_id, "busy", run_id)
            self.echo(f"[aws] reusing {h.instance_id} ({h.instance_type}, {h.availability_zone})")
            return h
        return host.launch(self.clients, self.cfg, inf, run_id, ngpu, echo=self.echo, sleep=self.sleep)

    def send(self, remote: RemoteRun, payload: list[str], what: str) -> str:
        cid = commands.send_shell(self.clients("ssm", remote.region), remote.instance_id, payload, self.cfg,
                                  remote.bucket, remote.bucket_region, f"hobson {what} {remote.run_id}")
        remote.commands.append({"what": what, "command_id": cid})
        self.echo(f"[aws] sent {what} command {cid} to {remote.instance_id}")
        return cid

    def wait(self, remote: RemoteRun, cid: str) -> commands.CommandResult:
        res = commands.wait_command(self.clients("ssm", remote.region), cid, remote.instance_id, self.cfg.poll,
                                    bucket=remote.bucket, prefix=self.cfg.output_prefix,
                                    deadline_s=self.cfg.execution_timeout_s + self.cfg.delivery_timeout_s,
                                    sleep=self.sleep)
        for c in remote.commands:
            if c["command_id"] == cid:
                c.update(status=res.status, output=res.output_s3)
        return res

    def start(self, argv: list[str], run_id: str, ngpu: int, *, revision: str = "HEAD", allow_dirty: bool = False,
              on_host: Callable[[RemoteRun], None] | None = None) -> RemoteRun:
        """Infrastructure, host, code, start command; returns once the run is running detached.

        ``on_host`` is called as soon as the host is known (to record it before anything else can fail).
        """
        inf = self.ensure_infra()
        with tempfile.TemporaryDirectory(prefix="hobson-code-") as tmp:
            archive_path = Path(tmp) / codesync.ARCHIVE_NAME
            archive = codesync.make_archive(self.repo, archive_path, revision, allow_dirty)
            self.echo(f"[aws] code {archive.revision[:12]}{' + working-tree diff' if archive.dirty else ''}: "
                      f"{archive.files} files, {archive.bytes} bytes, sha256 {archive.sha256[:12]}")
            h = self.acquire_host(inf, run_id, ngpu)
            remote = RemoteRun(run_id=run_id, bucket=inf.bucket, bucket_region=inf.bucket_region,
                               instance_id=h.instance_id, region=h.region, instance_type=h.instance_type,
                               launched=h.launched, host_home=self.cfg.host.home, argv=list(argv),
                               code=archive.manifest())
            if on_host:
                on_host(remote)
            akey, _ = codesync.upload(self.clients("s3", inf.bucket_region), inf.bucket, run_id, archive_path, archive)
        host.wait_online(self.clients("ssm", h.region), h.instance_id, self.cfg.online_timeout_s, sleep=self.sleep,
                         echo=self.echo)
        payload = start_payload(self.cfg, bucket=inf.bucket, bucket_region=inf.bucket_region, run_id=run_id,
                                code_key=akey, code_sha256=archive.sha256, argv=argv)
        res = self.wait(remote, self.send(remote, payload, "start"))
        if on_host:
            on_host(remote)
        if not res.ok:
            tail = commands.read_output(self.clients("s3", inf.bucket_region), res)
            raise HobsonError(f"starting the run failed: {res.describe()}"
                              + (f"\n--- end of its stderr ---\n{tail}" if tail else ""))
        self.echo(f"[aws] run {run_id} started on {h.instance_id}; mirror s3://{inf.bucket}/{remote.prefix}/")
        return remote

    # -----------------------------------------------------------------------------------------
    # reading the mirror

    def _get(self, remote: RemoteRun, key: str) -> bytes | None:
        try:
            return self.clients("s3", remote.bucket_region).get_object(
                Bucket=remote.bucket, Key=f"{remote.prefix}/{key}")["Body"].read()
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404"):
                return None
            raise

    def _keys(self, remote: RemoteRun) -> list[str]:
        s3 = self.clients("s3", remote.bucket_region)
        out: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=remote.bucket, Prefix=remote.prefix + "/"):
            out += [o["Key"][len(remote.prefix) + 1:] for o in page.get("Contents", [])]
        return out

    @staticmethod
    def _local_path(key: str, run_dir: Path, logs_dir: Path) -> Path:
        """Where a mirrored object lands locally; the host's run.json must not replace the local one."""
        if key.startswith("logs/"):
            return logs_dir / key[len("logs/"):]
        if key == "run.json":
            return run_dir / "host" / "run.json"
        if key.startswith("_host/"):
            return run_dir / "host" / key[len("_host/"):]
        return run_dir / key

    def _download(self, remote: RemoteRun, key: str, dest: Path) -> None:
        data = self._get(remote, key)
        if data is None:
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(dest, "wb") as f:
            f.write(data)

    def sync_records(self, remote: RemoteRun, run_dir: Path, logs_dir: Path) -> dict:
        """Copy the host's run.json, stages.jsonl, started/exit markers and logs; return the state."""
        keys = self._keys(remote)
        for key in keys:
            if key in ("run.json", "stages.jsonl") or key.startswith(("logs/", "_host/")):
                self._download(remote, key, self._local_path(key, run_dir, logs_dir))
        exit_info = json.loads((run_dir / "host" / "exit.json").read_text()) if "_host/exit.json" in keys else None
        return {"started": "_host/started.json" in keys, "exit": exit_info}

    def fetch(self, remote: RemoteRun, run_dir: Path, logs_dir: Path) -> list[Path]:
        """Copy everything the host mirrored (records, logs, outputs) into the local run directory."""
        out = []
        for key in self._keys(remote):
            dest = self._local_path(key, run_dir, logs_dir)
            self._download(remote, key, dest)
            out.append(dest)
        return out

    def log_text(self, remote: RemoteRun, name: str) -> str | None:
        data = self._get(remote, f"logs/{name}")
        return None if data is None else data.decode(errors="replace")

    def follow(self, remote: RemoteRun, run_dir: Path, logs_dir: Path, interval: float | None = None,
               timeout_s: float | None = None) -> int:
        """Print each stage as the mirror shows it ending; return the run's exit code."""
        interval = self.cfg.follow_interval_s if interval is None else interval
        t0 = time.monotonic()
        shown = 0
        while True:
            state = self.sync_records(remote, run_dir, logs_dir)
            stages = run_dir / "stages.jsonl"
            lines = stages.read_text().splitlines() if stages.exists() else []
            for line in lines[shown:]:
                r = json.loads(line)
                shard = "" if r.get("shard") is None else f" shard {r['shard']}"
                self.echo(f"[aws] {r['stage']}{shard}: {r['status']} in {r.get('wall_s', 0):.1f}s on "
                          f"{r.get('gpus') or 0} GPU(s), exit {r.get('exit_code')}")
            shown = len(lines)
            if state["exit"] is not None:
                code = int(state["exit"]["exit_code"])
                self.echo(f"[aws] run {remote.run_id} ended: exit {code}"
                          + (" (cancelled)" if state["exit"].get("cancelled") else ""))
                return code
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise HobsonError(f"run {remote.run_id} still running after {timeout_s:.0f}s")
            if not self._host_alive(remote):
                raise HobsonError(f"host {remote.instance_id} is gone (safety shutdown after "
                                  f"{self.cfg.safety_shutdown_minutes} min?) and the run recorded no exit; "
                                  f"what it mirrored is in s3://{remote.bucket}/{remote.prefix}/")
            self.sleep(interval)

    def _host_alive(self, remote: RemoteRun) -> bool:
        r = self.clients("ec2", remote.region).describe_instances(InstanceIds=[remote.instance_id])
        states = [i["State"]["Name"] for res in r.get("Reservations", []) for i in res.get("Instances", [])]
        return bool(states) and states[0] in ("pending", "running")

    def cancel(self, remote: RemoteRun) -> commands.CommandResult:
        return self.wait(remote, self.send(remote, cancel_payload(self.cfg, remote.run_id), "cancel"))

    def release(self, remote: RemoteRun) -> list[str]:
        """Terminate the run's host if this run launched it and the config says so; else mark it idle."""
        if not (self.cfg.terminate_after_run and remote.launched):
            host.set_state(self.clients, remote.region, remote.instance_id, "idle")
            self.echo(f"[aws] {remote.instance_id} kept (idle) for the next run; aws/teardown ends it")
            return []
        ids = host.terminate(self.clients, self.cfg, remote.region, [remote.instance_id])
        for i in ids:
            self.echo(f"[aws] terminated {i}")
        return ids

    def teardown(self, regions: list[str] | None = None, run_id: str | None = None) -> dict[str, list[str]]:
        return host.teardown(self.clients, self.cfg, regions, run_id)


def dry_run(cfg: AwsConfig, argv: list[str], run_id: str, ngpu: int, *, repo: Path = REPO_ROOT,
            revision: str = "HEAD", allow_dirty: bool = True, out: Callable[[str], None] = print) -> None:
    """Print every AWS call a first run in an empty account makes, and the host command; call nothing."""
    clients = Clients(dry_run=True, out=out)
    r = Runner(cfg, clients, repo=repo, echo=lambda s: out(f"# {s}"), sleep=lambda s: None)
    try:
        codesync.make_archive(repo, Path(tempfile.mkdtemp(prefix="hobson-dry-")) / "c.tar.gz", revision, allow_dirty)
    except HobsonError as e:
        out(f"# note: a real run would stop here: {e}")
        out("# (the dry run goes on with the working tree, as --allow-dirty would)")
        allow_dirty = True
    remote = r.start(argv, run_id, ngpu, revision=revision, allow_dirty=allow_dirty)
    out(f"# then every {cfg.follow_interval_s:g}s: s3.list_objects_v2 / get_object under "
        f"s3://{remote.bucket}/{remote.prefix}/ until _host/exit.json appears; then fetch every object there")
    if cfg.terminate_after_run:
        out(f"# then ec2.terminate_instances [{remote.region}] for the launched host "
            f"(tag {cfg.tag_key}={cfg.tag_value})")
    out("# the host command (AWS-RunShellScript commands, one per line):")
    payload = start_payload(cfg, bucket=remote.bucket, bucket_region=remote.bucket_region, run_id=run_id,
                            code_key=codesync.code_keys(run_id)[0], code_sha256=remote.code["sha256"], argv=argv)
    for line in payload:
        out(f"    {line}")
