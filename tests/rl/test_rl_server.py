"""The rollout server and the remote engine on localhost (no Slurm): a run whose engine is a
server in another process gives the same bits as the in-process engine; refused publications
come back as the same errors; a hung or vanished server is reported within the timeout, naming
the rollout component; a request without the job's secret is refused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from hobson.errors import ConfigError, DigestMismatch
from hobson.io import read_jsonl
from hobson.jobs.rl import main
from hobson.rl.verify_resume import compare_runs
from hobson.rollout.transport import (
    AuthError,
    RemoteEngine,
    RolloutEngineError,
    make_secret,
    read_address,
    read_secret,
    request,
)

ARGS = [
    "--algorithm", "grpo", "--reward", "test-token-value", "--max-new-tokens", "6",
    "--prompts-per-update", "2", "--completions-per-prompt", "2", "--updates", "2", "--lr", "0.1",
]


def test_remote_engine_is_bit_identical(tmp_path: Path, server: tuple[Path, subprocess.Popen[str]],
                                        one_thread: None) -> None:
    addr, proc = server
    node = json.loads(addr.read_text())["node"]  # the server removes the file when it shuts down
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert main([*ARGS, "--output", str(local)]) == 0
    assert main([*ARGS, "--output", str(remote), "--engine-address-file", str(addr), "--engine-timeout", "120"]) == 0
    items = compare_runs(local, remote)
    assert [i.line() for i in items if i.difference] == []
    assert len(items) > 10
    rows = read_jsonl(remote / "rollouts" / "update-000002.jsonl")
    assert rows and {r["engine_node"] for r in rows} == {node}
    assert "engine_node" not in read_jsonl(local / "rollouts" / "update-000002.jsonl")[0]
    # the trainer's close() shut the server down, and the server removed its address file
    assert proc.wait(timeout=30) == 0
    assert not addr.exists()


def test_flipped_byte_refused_by_remote_engine(tmp_path: Path, server: tuple[Path, subprocess.Popen[str]],
                                              one_thread: None) -> None:
    addr, _ = server
    out = tmp_path / "run"
    assert main([*ARGS, "--updates", "1", "--output", str(out)]) == 0
    pub = out / "publications" / "v000001"
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(pub, bad)
    st = bad / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[-1] ^= 0x01
    st.write_bytes(bytes(data))
    man = json.loads((pub / "manifest.json").read_text())
    eng = RemoteEngine(addr, dtype_name="float32", eos_id=0, pad_id=0, model_revision=man["model_revision"],
                       engine_revision="x", torch_threads=1, request_timeout=60, publish_timeout=60, ready_timeout=10)
    assert eng.load_publication(pub).digest == man["digest"]
    with pytest.raises(DigestMismatch, match="refusing version 1"):
        eng.load_publication(bad)
    assert request(eng.address, {"op": "ping"}, 10)["digest"] == man["digest"]  # the old weights still serve
    eng.close()


def test_hung_and_gone_server_named(tmp_path: Path, server: tuple[Path, subprocess.Popen[str]]) -> None:
    addr, proc = server
    address = json.loads(addr.read_text())
    os.kill(proc.pid, signal.SIGSTOP)  # a hung engine: the port accepts (kernel backlog), nobody answers
    try:
        t0 = time.monotonic()
        with pytest.raises(RolloutEngineError, match=r"rollout component .* no answer to 'ping' within 2 s"):
            request(address, {"op": "ping"}, timeout=2)
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait(timeout=30)
    with pytest.raises(RolloutEngineError, match=r"rollout component .*'ping' failed"):
        request(address, {"op": "ping"}, timeout=2)


def test_request_without_the_secret_is_refused_and_changes_nothing(
        tmp_path: Path, server: tuple[Path, subprocess.Popen[str]]) -> None:
    """Anyone on the cluster network could reach the port: without the job's secret no request
    (ping, configure, load, generate, shutdown) is served, and the server is as it was."""
    addr, proc = server
    address = read_address(addr)
    assert address is not None
    secret_file = Path(address["secret_file"])
    assert secret_file.parent == addr.parent and stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert "secret" not in json.loads(addr.read_text())  # the address file names the secret, never holds it
    before = request(address, {"op": "ping"}, 10)
    assert before["configured"] is False and before["version"] is None
    assert before["gpu_uuid"] is None  # a CPU server: nothing NCCL could confuse
    bare = {k: v for k, v in address.items() if k != "secret"}
    payloads = [
        {"op": "ping"},
        {"op": "configure", "dtype": "float32", "eos_id": 0, "pad_id": 0, "model_revision": "m",
         "engine_revision": "e", "torch_threads": 1},
        {"op": "load_publication", "transport": "shared-dir", "path": str(tmp_path / "anything")},
        {"op": "generate", "prompts": [[1]], "seeds": [0], "temperature": 1.0, "max_new_tokens": 1},
        {"op": "shutdown"},
    ]
    for who in (bare, {**bare, "secret": "0" * 64}, {**bare, "secret": address["secret"][:-1]}):
        for payload in payloads:
            with pytest.raises(AuthError, match="does not carry this job's rollout secret"):
                request(who, payload, 10)
    assert proc.poll() is None  # the refused shutdown did not stop it
    assert request(address, {"op": "ping"}, 10) == before
    # it listens on the address it advertises (127.0.0.1), not on every interface
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", int(address["port"])), timeout=5).close()


def test_a_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "address-1.secret"
    secret = make_secret(path)
    assert make_secret(path) == secret and len(secret) == 64  # a second server of the job reads the same one
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by others \(mode 644\).*chmod 600"):
        read_secret(path)
    path.write_text("short")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="not a rollout secret"):
        read_secret(path)
