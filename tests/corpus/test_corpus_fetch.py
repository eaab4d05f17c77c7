"""``fetch`` against a loopback HTTP server: resumed Range requests, refused digests, config errors."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hobson.corpus.fetch import load_fetch_config
from hobson.corpus.stages import run_build, run_fetch
from hobson.errors import ConfigError, DataError, DigestMismatch, StageError
from hobson.io import dumps_row

PAYLOAD = bytes(range(256)) * 800  # 204,800 bytes: several read chunks


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.ranges: list[str | None] = []  # the Range header of every GET, in order
        self.drop_once = False  # next full GET sends half the body, then closes the connection


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        data = self.server.files.get(self.path)
        rng = self.headers.get("Range")
        self.server.ranges.append(rng)
        if data is None:
            self.send_error(404)
            return
        start = 0
        if rng:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.server.drop_once and not rng:
            self.server.drop_once = False
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True  # the client sees EOF before Content-Length bytes
            return
        self.wfile.write(body)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server({"/data.bin": PAYLOAD})
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _config(tmp_path: Path, server: _Server, path: str, data: bytes, sha256: str | None = None,
            fmt: str = "") -> Path:
    url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    digest = sha256 or hashlib.sha256(data).hexdigest()
    cfg = tmp_path / "fetch.yaml"
    text = f"sources:\n  - name: {path.lstrip('/')}\n    url: {url}\n    size: {len(data)}\n    sha256: {digest}\n"
    cfg.write_text(text + (f"    format: {fmt}\n" if fmt else ""), encoding="utf-8")
    return cfg


def test_interrupted_download_resumes_with_range(tmp_path: Path, server: _Server) -> None:
    server.drop_once = True
    d = tmp_path / "d"
    paths = run_fetch(d, _config(tmp_path, server, "/data.bin", PAYLOAD), backoff_s=0.0)
    assert server.ranges == [None, f"bytes={len(PAYLOAD) // 2}-"]
    assert (d / "raw" / "data.bin").read_bytes() == PAYLOAD
    assert paths == [d / "raw" / "data.bin", d / "raw" / "MANIFEST.json"]
    assert sorted(p.name for p in (d / "raw").iterdir()) == ["MANIFEST.json", "SHA256SUMS", "data.bin"]
    manifest = json.loads((d / "raw" / "MANIFEST.json").read_text())
    assert [s["name"] for s in manifest["sources"]] == ["data.bin"]
    # a second run finds it present and verified: no request at all
    run_fetch(d, _config(tmp_path, server, "/data.bin", PAYLOAD), backoff_s=0.0)
    assert len(server.ranges) == 2


def test_partial_file_from_a_failed_run_is_resumed_by_the_next(tmp_path: Path, server: _Server) -> None:
    server.drop_once = True
    d = tmp_path / "d"
    cfg = _config(tmp_path, server, "/data.bin", PAYLOAD)
    with pytest.raises(StageError, match=r"failed after 1 attempts.*rerun to resume"):
        run_fetch(d, cfg, retries=0)
    assert (d / "raw" / ".data.bin.part").stat().st_size == len(PAYLOAD) // 2
    run_fetch(d, cfg, retries=0)
    assert server.ranges[-1] == f"bytes={len(PAYLOAD) // 2}-"
    assert (d / "raw" / "data.bin").read_bytes() == PAYLOAD


def test_wrong_digest_is_refused_and_leaves_nothing(tmp_path: Path, server: _Server) -> None:
    server.drop_once = True  # also after a resume: the .part must go too
    d = tmp_path / "d"
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(DigestMismatch) as exc:
        run_fetch(d, _config(tmp_path, server, "/data.bin", PAYLOAD, sha256=wrong), backoff_s=0.0)
    assert wrong in str(exc.value) and hashlib.sha256(PAYLOAD).hexdigest() in str(exc.value)
    assert list((d / "raw").iterdir()) == []


def test_unknown_config_keys_are_named_with_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "fetch.yaml"
    cfg.write_text(
        "mirrors: []\nsources:\n  - name: a.jsonl\n    url: http://127.0.0.1/a\n    size: 3\n"
        f"    sha256: {'a' * 64}\n    checksum: x\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as exc:
        load_fetch_config(cfg)
    msg = str(exc.value)
    assert msg.startswith(f"{cfg}: ")
    assert "unknown key 'mirrors'" in msg and "sources[0]: unknown key 'checksum'" in msg


def test_shipped_config_is_empty() -> None:
    assert load_fetch_config(Path(__file__).resolve().parents[2] / "configs" / "fetch.yaml") == []


def test_build_reads_fetched_qa_source(tmp_path: Path, server: _Server) -> None:
    lines = [{"question": f"What is {i} + {i}?", "options": [str(2 * i), str(2 * i + 1)], "answer": 0}
             for i in range(60)]
    data = "".join(dumps_row(x) + "\n" for x in lines).encode()
    server.files["/qa.jsonl"] = data
    d = tmp_path / "d"
    run_fetch(d, _config(tmp_path, server, "/qa.jsonl", data, fmt="qa-jsonl"))
    train, ev = run_build(d)
    source = (d / "build" / "SOURCE").read_text()
    assert source == f"raw:qa.jsonl sha256={hashlib.sha256(data).hexdigest()}\n"
    n_train = sum(1 for _ in train.open())
    n_eval = sum(1 for _ in ev.open())
    assert n_train + n_eval == 60 and n_eval > 0 and n_train > 0


def test_bad_raw_row_stops_build_and_leaves_no_output(tmp_path: Path) -> None:
    # file:// sources go through the same download path (no server needed)
    src = tmp_path / "qa.jsonl"
    src.write_text('{"question": "Q?", "options": ["a", "b"], "answer": 0}\n'
                   '{"question": "R?", "options": ["a", "b"], "answer": 2}\n', encoding="utf-8")
    data = src.read_bytes()
    cfg = tmp_path / "fetch.yaml"
    cfg.write_text(f"sources:\n  - name: qa.jsonl\n    url: {src.as_uri()}\n    size: {len(data)}\n"
                   f"    sha256: {hashlib.sha256(data).hexdigest()}\n    format: qa-jsonl\n", encoding="utf-8")
    d = tmp_path / "d"
    run_fetch(d, cfg)
    where = re.escape(str(d / "raw" / "qa.jsonl"))
    with pytest.raises(DataError, match=rf"^{where}:2: answer must be an option index"):
        run_build(d)
    assert list((d / "build").iterdir()) == []
