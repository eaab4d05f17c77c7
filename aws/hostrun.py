"""Host side: run one launcher command detached and mirror its record to S3.

    python -m aws.hostrun --bucket B --prefix runs/<id> --run-dir R --logs-dir L -- launch/submit.py recipe ...

Started by the SSM command under ``nohup setsid``, so it outlives that command. It runs
``python ARGV`` as a child, and copies to ``s3://B/<prefix>/``:

- ``run.json``, ``stages.jsonl`` and ``logs/*`` every ``--interval`` seconds;
- everything under the run directory (outputs too) whenever ``stages.jsonl`` grows (a stage
  ended) and once more when the child exits;
- ``_host/started.json`` at the start and ``_host/exit.json`` (exit code) as the very last object.

Only files whose size or mtime changed since their last upload are sent. SIGTERM is passed to
the child (the local backend then stops its tasks and records them), and the exit is still
mirrored. Needs only the standard library and boto3, which honours ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


def _utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Mirror:
    def __init__(self, s3, bucket: str, prefix: str, run_dir: Path, logs_dir: Path) -> None:
        self.s3, self.bucket, self.prefix = s3, bucket, prefix.strip("/")
        self.run_dir, self.logs_dir = run_dir, logs_dir
        self._sent: dict[Path, tuple[int, int]] = {}

    def _put(self, path: Path, key: str) -> None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        sig = (st.st_size, st.st_mtime_ns)
        if self._sent.get(path) == sig:
            return
        self.s3.upload_file(str(path), self.bucket, f"{self.prefix}/{key}")
        self._sent[path] = sig

    def records(self) -> None:
        """run.json, stages.jsonl and every log: small, sent often."""
        for name in ("run.json", "stages.jsonl"):
            self._put(self.run_dir / name, name)
        if self.logs_dir.is_dir():
            for p in sorted(self.logs_dir.iterdir()):
                if p.is_file():
                    self._put(p, f"logs/{p.name}")

    def everything(self) -> None:
        """The records, then every file of the run directory (outputs, checkpoints, reports)."""
        self.records()
        if self.run_dir.is_dir():
            for p in sorted(self.run_dir.rglob("*")):
                if p.is_file() and not p.name.endswith(".tmp"):
                    self._put(p, p.relative_to(self.run_dir).as_posix())

    def put_json(self, key: str, obj: dict) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}",
                           Body=(json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(),
                           ContentType="application/json")


def supervise(argv: list[str], mirror: Mirror, interval: float, poll: float, own_log: Path | None) -> int:
    mirror.put_json("_host/started.json", {"argv": argv, "pid": os.getpid(), "host": socket.gethostname(),
                                           "started_utc": _utc()})
    mirror.logs_dir.mkdir(parents=True, exist_ok=True)
    launcher_log = open(mirror.logs_dir / "launcher.log", "ab")
    child = subprocess.Popen([sys.executable, *argv], stdout=launcher_log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
    cancelled = False

    def on_term(signum, frame) -> None:
        nonlocal cancelled
        cancelled = True
        child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    stages = mirror.run_dir / "stages.jsonl"
    seen_size, last = -1, 0.0
    while True:
        code = child.poll()
        size = stages.stat().st_size if stages.exists() else 0
        try:
            if size != seen_size:  # a stage (or array task) just ended: its outputs are final
                mirror.everything()
                seen_size, last = size, time.monotonic()
            elif time.monotonic() - last >= interval:
                mirror.records()
                last = time.monotonic()
        except Exception as e:  # a failed upload must not kill the run; the next round retries
            print(f"[hostrun] mirror failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if code is not None:
            break
        time.sleep(poll)
    launcher_log.close()
    for attempt in range(5):
        try:
            mirror.everything()
            if own_log is not None and own_log.exists():
                mirror._put(own_log, "_host/hostrun.log")
            mirror.put_json("_host/exit.json", {"exit_code": code, "cancelled": cancelled, "ended_utc": _utc()})
            break
        except Exception as e:
            print(f"[hostrun] final mirror failed (attempt {attempt + 1}): {e}", file=sys.stderr, flush=True)
            time.sleep(2 ** attempt)
    print(f"[hostrun] run ended: exit {code}{' (cancelled)' if cancelled else ''}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m aws.hostrun OPTIONS -- ARGV (see --help)", file=sys.stderr)
        if "-h" not in argv and "--help" not in argv:
            return 2
    i = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m aws.hostrun", description=__doc__.split("\n")[0])
    p.add_argument("--bucket", required=True, help="S3 bucket the run is mirrored to")
    p.add_argument("--prefix", required=True, help="key prefix, e.g. runs/<run id>")
    p.add_argument("--run-dir", required=True, type=Path, help="the run directory the launcher writes")
    p.add_argument("--logs-dir", required=True, type=Path, help="the run's log directory (<logs root>/<run id>)")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between record/log copies")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between checks of the child and stages.jsonl")
    p.add_argument("--own-log", type=Path, default=None, help="this process's own log, copied at the end")
    args = p.parse_args(argv[:i])
    import boto3

    mirror = Mirror(boto3.client("s3"), args.bucket, args.prefix, args.run_dir, args.logs_dir)
    return supervise(argv[i + 1 :], mirror, args.interval, args.poll, args.own_log)


if __name__ == "__main__":
    sys.exit(main())
