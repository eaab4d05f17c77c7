"""Fixtures: the real server on a free port, over the session's tiny trained and calibrated
decider (``calibrated``, tests/conftest.py: one epoch of the decider tests' tiny Qwen3 torso,
calibrated by the real job). A server is ``python -m jobs.serve`` in its own process, talked to
over HTTP with httpx. Its TEST-ONLY hold points (``serve-forward``, ``serve-load``;
:mod:`hobson.faults`) start released; a test arms one to hold the worker inside a forward, so the
queue fills at a known moment and never because the machine is slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hobson import faults
from hobson.io import dumps_row, read_jsonl

REPO = Path(__file__).resolve().parents[2]
CAP = 512  # --max-batch-tokens of the shared server: small enough that grouping by length matters
QUEUE = 16
PER_REQUEST = 8


@pytest.fixture(scope="session")
def rows(decider_data) -> list[dict]:
    """Every kind, 2..5 options, states of 0..45 words: 49 rows."""
    return read_jsonl(decider_data["train"]) + read_jsonl(decider_data["val"])


class Server:
    """One ``python -m jobs.serve`` process and an HTTP client for it."""

    def __init__(self, ckpt: Path, work: Path, *extra: str, env: dict[str, str] | None = None,
                 released: tuple[str, ...] = ("serve-forward", "serve-load"), wait_ready: bool = True) -> None:
        self.work = work
        self.holds = work / "holds"
        self.holds.mkdir(parents=True, exist_ok=True)
        for point in released:
            faults.release(self.holds, point)
        self.address_file = work / "address.json"
        self.log = work / "server.log"
        full_env = {**os.environ, "HOBSON_TEST_HOLD": "serve-forward,serve-load",
                    "HOBSON_TEST_HOLD_DIR": str(self.holds), "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobs.serve", str(ckpt), "--port", "0", "--address-file", str(self.address_file),
             "--threads", "1", *extra],
            cwd=REPO, env=full_env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        self.url = self._wait_address()
        self.client = httpx.Client(base_url=self.url, timeout=60)
        if wait_ready:
            self.wait_ready()

    def _wait_address(self, timeout_s: float = 120) -> str:
        end = time.monotonic() + timeout_s
        while not self.address_file.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > end:
                raise AssertionError(f"no address within {timeout_s} s:\n{self.output()}")
            time.sleep(0.05)
        return json.loads(self.address_file.read_text())["url"]

    def wait_ready(self, timeout_s: float = 120) -> dict:
        end = time.monotonic() + timeout_s
        while True:
            r = self.client.get("/healthz")
            if r.status_code == 200:
                return r.json()
            assert r.json()["status"] == "loading", (r.json(), self.output())
            if time.monotonic() > end:
                raise AssertionError(f"not ready within {timeout_s} s:\n{self.output()}")
            time.sleep(0.05)

    def health(self) -> dict:
        return self.client.get("/healthz").json()

    def wait_queued(self, n: int, timeout_s: float = 60) -> None:
        """Until the server holds ``n`` questions (the test's requests all arrived)."""
        end = time.monotonic() + timeout_s
        while (held := self.health()["queued"]) != n:
            assert time.monotonic() < end, f"{held} questions held, waiting for {n}"
            time.sleep(0.02)

    def arm(self, point: str = "serve-forward") -> None:
        (self.holds / f"{point}.release").unlink(missing_ok=True)
        for old in self.holds.glob(f"{point}.held.*"):
            old.unlink()

    def wait_held(self, point: str = "serve-forward") -> None:
        faults.wait_held(self.holds, point, 60, alive=lambda: self.proc.poll() is None)

    def release(self, point: str = "serve-forward") -> None:
        faults.release(self.holds, point)

    def decide(self, questions: list[dict], **kw) -> httpx.Response:
        return self.client.post("/v1/decide", json={"questions": questions}, **kw)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def question(row: dict) -> dict:
    return {k: row[k] for k in ("state", "instructions", "options", "kind")}


@pytest.fixture(scope="module")
def server(calibrated, tmp_path_factory) -> Iterator[Server]:
    s = Server(calibrated, tmp_path_factory.mktemp("server"), "--max-batch-tokens", str(CAP),
               "--max-queue", str(QUEUE), "--max-questions", str(PER_REQUEST), "--max-body-bytes", "65536")
    yield s
    code = s.stop()
    assert code == 0, s.output()


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(dumps_row(r) + "\n" for r in rows), encoding="utf-8")
    return path
