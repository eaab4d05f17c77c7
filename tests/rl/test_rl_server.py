"""The rollout server and the remote engine on localhost (no Slurm): a run whose engine is a
server in another process gives the same bits as the in-process engine; refused publications
come back as the same errors; a hung or vanished server is reported within the timeout, naming
the rollout component.
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

import pytest
import torch

from hobson.errors import DigestMismatch
from hobson.io import read_jsonl
from hobson.jobs.rl import main
from hobson.rl.verify_resume import compare_runs
from hobson.rollout.transport import RemoteEngine, RolloutEngineError, request, wait_ready

REPO = Path(__file__).resolve().parents[2]
ARGS = [
    "--algorithm", "grpo", "--reward", "test-token-value", "--max-new-tokens", "6",
    "--prompts-per-update", "2", "--completions-per-prompt", "2", "--updates", "2", "--lr", "0.1",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]), OMP_NUM_THREADS="1")
    return env


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    addr = tmp_path / "engine" / "address.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.rollout_server", "--address-file", str(addr), "--advertise", "127.0.0.1"],
        cwd=REPO, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    wait_ready(addr, 60, watch_pid=proc.pid)
    yield addr, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
