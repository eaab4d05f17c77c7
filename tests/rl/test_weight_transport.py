"""``--transport dist``: each version goes from the trainer's memory to the engine (a process group
of its own with a rollout server, a direct hand-off in-process), no publication file on the
critical path, and the run is byte for byte the shared-directory run: tokens, log-probs, rewards,
traces, weights, optimizer and RNG state, and every version's digest. A bucket damaged in flight
is refused by the engine's digest check and sent again; a server that dies mid-broadcast fails
the run within its timeout, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hobson import faults
from hobson.errors import ConfigError
from hobson.io import read_jsonl
from hobson.jobs.rl import main
from hobson.models import get_provider
from hobson.models.registry import tiny_config
from hobson.rl.verify_resume import compare_runs
from hobson.rollout import publication
from hobson.rollout.transport import _pack, _unpack, bucket_layout, check_own_gpus, tensor_meta
from tests.rl.servers import REPO, server_env, start_server, stop_server

ARGS = [
    "--algorithm", "grpo", "--reward", "test-token-value", "--max-new-tokens", "6", "--trainer", "torch",
    "--prompts-per-update", "2", "--completions-per-prompt", "2", "--updates", "2", "--lr", "0.1",
]
REMOTE = ["--engine-timeout", "60", "--publish-timeout", "60", "--weight-bucket-mb", "0.01"]  # many buckets


def _differences(a: Path, b: Path) -> list[str]:
    items = compare_runs(a, b)
    assert len(items) > 20
    return [i.line() for i in items if i.difference]


def _publish_events(run: Path) -> list[dict]:
    meta = json.loads((run / "run.json").read_text())
    return [e for s in meta["rl"]["sessions"] for e in s["events"] if e["event"] == "publish"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared-directory run every transport must equal."""
    out = tmp_path_factory.mktemp("shared") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*ARGS, "--output", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("kind", ["huginn_raven", "nanbeige"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_staged_version_has_the_written_publications_digest(tmp_path: Path, kind: str, dtype: torch.dtype) -> None:
    provider = get_provider(tiny_config(kind))
    actor = provider.build_actor(tiny_config(kind), seed=3)
    staged = publication.stage(provider, actor, 0, model_revision="m", engine_revision="e", dtype=dtype)
    written = publication.publish(provider, actor, tmp_path, 0, model_revision="m", engine_revision="e", dtype=dtype)
    assert staged.manifest.digest == written.digest
    assert staged.manifest.files == {} and written.files
    on_disk = publication.read_tensors(publication.version_dir(tmp_path, 0))
    assert sorted(on_disk) == sorted(staged.tensors)
    assert all(torch.equal(on_disk[n], staged.tensors[n]) and on_disk[n].dtype == staged.tensors[n].dtype
               for n in on_disk)
    assert json.loads((publication.version_dir(tmp_path, 0) / "config.json").read_text()) == staged.config


def test_buckets_carry_every_byte_aligned() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, generator=g).half(),  # 14 bytes: the next tensor starts aligned all the same
        "b": torch.randn(3, 5, generator=g),
        "c": torch.randint(0, 100, (2, 3), generator=g),
        "d": torch.randn(1000, generator=g),  # larger than a bucket: travels alone
        "e": torch.zeros(0),
        "f": torch.tensor(2.5, dtype=torch.bfloat16),
    }
    meta = tensor_meta(tensors)
    buckets = bucket_layout(meta, 256)
    assert [b[:2] for b in buckets] == [[0, 3], [3, 4], [4, 6]]
    out: dict[str, torch.Tensor] = {}
    for b in buckets:
        buf = _pack(tensors, meta, b, "cpu")
        assert buf.numel() == b[2] and buf.numel() % 64 == 0
        _unpack(buf.clone(), meta, b, out)
    assert sorted(out) == sorted(tensors)
    for n, t in tensors.items():
        assert out[n].dtype == t.dtype and out[n].shape == t.shape
        assert out[n].view(torch.uint8).tolist() == t.view(torch.uint8).tolist() if t.dim() else torch.equal(out[n], t)
    assert publication.tensors_digest(out) == publication.tensors_digest(tensors)


def test_in_process_hand_off_equals_the_shared_directory(tmp_path: Path, reference: Path, one_thread: None) -> None:
    out = tmp_path / "run"
    assert main([*ARGS, "--output", str(out), "--transport", "dist"]) == 0
    assert _differences(reference, out) == []
    assert not (out / "publications").exists()  # nothing written: the engine took the tensors
    assert [e["transport"] for e in _publish_events(out)] == ["dist"] * 3
    assert (out / "checkpoints" / "update-000002" / "actor.safetensors").exists()  # the checkpoint holds the actor


def test_remote_dist_stopped_and_resumed_equals_the_shared_directory(tmp_path: Path, reference: Path,
                                                                    one_thread: None) -> None:
    """Stopped after update 1 and resumed against a fresh server, both under dist: the same bits as
    the uninterrupted shared-directory run, and no publication file anywhere."""
    addr = tmp_path / "engine" / "address.json"
    out = tmp_path / "run"
    run = [*ARGS, *REMOTE, "--output", str(out), "--transport", "dist", "--engine-address-file", str(addr)]
    for extra in (["--stop-after", "1"], ["--resume"]):
        proc = start_server(addr)
        try:
            assert main([*run, *extra]) == 0
            assert proc.wait(timeout=30) == 0  # the trainer shut it down
        finally:
            stop_server(proc)
    assert _differences(reference, out) == []
    assert not (out / "publications").exists()  # the engine opened no publication file: none exists
    rows = read_jsonl(out / "rollouts" / "update-000002.jsonl")
    assert rows and all(r["engine_node"] for r in rows)
    # version 1 twice: published by the first session, republished by the resume from checkpoint 1
    assert [(e["version"], e["transport"]) for e in _publish_events(out)] == [
        (0, "dist"), (1, "dist"), (1, "dist"), (2, "dist")]


def test_a_bucket_damaged_in_flight_is_refused_and_sent_again(tmp_path: Path, reference: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str],
                                                              one_thread: None) -> None:
    holds = tmp_path / "holds"
    monkeypatch.setenv(faults.ENV_POINTS, "corrupt-weights-v1")
    monkeypatch.setenv(faults.ENV_DIR, str(holds))
    addr = tmp_path / "engine" / "address.json"
    proc = start_server(addr)
    try:
        out = tmp_path / "run"
        assert main([*ARGS, *REMOTE, "--output", str(out), "--transport", "dist", "--engine-address-file",
                     str(addr)]) == 0
    finally:
        stop_server(proc)
    assert (holds / "corrupt-weights-v1.release").exists()  # the fault fired, once
    said = capsys.readouterr().out
    assert "version 1 arrived damaged" in said and "digest of the tensors received is" in said, said
    events = _publish_events(out)
    assert [(e["version"], e.get("resent", 0)) for e in events] == [(0, 0), (1, 1), (2, 0)]
    assert _differences(reference, out) == []  # what the engine committed is exactly the trainer's


def test_a_server_that_dies_mid_broadcast_fails_the_run_naming_it(tmp_path: Path) -> None:
    holds = tmp_path / "holds"
    addr = tmp_path / "engine" / "address.json"
    proc = start_server(addr, **{faults.ENV_POINTS: "receive-weights-v1-bucket-2", faults.ENV_DIR: str(holds)})
    try:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "jobs.rl", *ARGS, "--output", str(tmp_path / "run"), "--transport", "dist",
             "--engine-address-file", str(addr), "--engine-timeout", "30", "--publish-timeout", "30",
             "--weight-bucket-mb", "0.01"],
            cwd=REPO, env=server_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pid = faults.wait_held(holds, "receive-weights-v1-bucket-2", 120, alive=lambda: trainer.poll() is None)
        assert pid == proc.pid
        proc.kill()  # mid-broadcast: bucket 2 of version 1 received, the rest not
        t0 = time.monotonic()
        out, _ = trainer.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        stop_server(proc)
    assert trainer.returncode != 0
    assert f"server pid {proc.pid}" in out and "rollout component" in out, out
    assert "weight broadcast of version 1 failed" in out, out
    assert elapsed < 30  # within the group's (publish) timeout: the closed connection is seen at once


def test_dist_over_nccl_refuses_a_server_on_a_gpu_already_in_the_group() -> None:
    """NCCL puts one rank on one GPU: a rollout server on the trainer's GPU, or two servers on one
    GPU, is refused by name before the group forms; CPU servers (gloo) and distinct GPUs pass."""
    a = [{"host": "n1", "port": 5000 + i, "pid": 100 + i, "node": "n1"} for i in range(3)]
    trainer = ("n1", "GPU-0")
    check_own_gpus(trainer, [(a[0], {"node": "n1", "gpu_uuid": "GPU-1"}), (a[1], {"node": "n2", "gpu_uuid": "GPU-0"})])
    check_own_gpus(("n1", None), [(a[0], {"node": "n1", "gpu_uuid": None}), (a[1], {"node": "n1", "gpu_uuid": None})])
    with pytest.raises(ConfigError, match=r"rollout server 1 \(.*5001.*\) is on the same GPU as the trainer "
                                          r"\(weight group rank 0\) \(GPU-0 on n1\).*--transport shared-dir"):
        check_own_gpus(trainer, [(a[0], {"node": "n1", "gpu_uuid": "GPU-1"}),
                                 (a[1], {"node": "n1", "gpu_uuid": "GPU-0"})])
    with pytest.raises(ConfigError, match=r"rollout server 2 .* same GPU as rollout server 0 \(GPU-7 on n2\)"):
        check_own_gpus(trainer, [(a[0], {"node": "n2", "gpu_uuid": "GPU-7"}),
                                 (a[1], {"node": "n1", "gpu_uuid": "GPU-1"}),
                                 (a[2], {"node": "n2", "gpu_uuid": "GPU-7"})])
