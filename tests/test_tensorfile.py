"""hobson.tensorfile (threaded safetensors writes), the chunked manifest, and the RL checkpoint's
state tensors in state.safetensors: what is written reads back bit for bit, with safetensors' own
reader, and damage is named down to the chunk."""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hobson import bytepool, manifest, tensorfile
from hobson.rl import checkpoint as ckpt


def _tensors(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(37, 11, generator=g),
        "bf16": torch.randn(5, 129, generator=g).to(torch.bfloat16),
        "f16": torch.randn(300, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "u8": torch.randint(0, 255, (1000,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(33, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(8, 6, generator=g).t(),  # not contiguous
    }
    return {k: v.to(device) for k, v in out.items()}


def _equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        x, y = a[k].cpu(), b[k].cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert ckpt.first_difference(x, y, k) is None


@pytest.mark.parametrize("piece", [tensorfile.PIECE, 7, 64])
def test_save_reads_back_with_safetensors_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      piece: int) -> None:
    """Pieces of 7 bytes cut every tensor at odd offsets, across dtype boundaries."""
    monkeypatch.setattr(tensorfile, "PIECE", piece)
    tensors = _tensors()
    size = tensorfile.save(tensors, tmp_path / "a.safetensors", metadata={"format": "pt"})
    assert size == (tmp_path / "a.safetensors").stat().st_size
    _equal_bits(tensors, load_file(str(tmp_path / "a.safetensors")))
    # the same tensors through safetensors' own writer read back the same
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "b.safetensors"))
    _equal_bits(load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors")))
    header_len = int.from_bytes((tmp_path / "a.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0
    assert json.loads((tmp_path / "a.safetensors").read_bytes()[8 : 8 + header_len])["__metadata__"] == {"format": "pt"}


def test_a_failed_piece_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorfile, "PIECE", 64)
    calls = [0]
    real = tensorfile._write_cpu

    def flaky(fd: int, flat: torch.Tensor, start: int, stop: int, offset: int) -> None:
        calls[0] += 1
        if start == 64:  # the second piece of some tensor
            raise OSError(28, "No space left on device")
        real(fd, flat, start, stop, offset)

    monkeypatch.setattr(tensorfile, "_write_cpu", flaky)
    with pytest.raises(OSError, match="No space left"):
        tensorfile.save(_tensors(), tmp_path / "a.safetensors")
    assert calls[0] > 2


def _big_dir(tmp_path: Path) -> Path:
    d = tmp_path / "d"
    d.mkdir()
    (d / "big.bin").write_bytes(bytes(range(256)) * 40 + b"tail")  # 10,244 bytes: 11 chunks of 1,000
    (d / "small.txt").write_text("hello\n")
    return d


def test_manifest_hashes_large_files_in_chunks_and_names_the_damaged_one(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "CHUNK", 1000)
    d = _big_dir(tmp_path)
    files = manifest.write(d, kind="test")
    data = (d / "big.bin").read_bytes()
    assert files["big.bin"] == {"bytes": len(data), "chunk_bytes": 1000, "sha256_chunks": [
        hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]}
    assert files["small.txt"] == {"bytes": 6, "sha256": hashlib.sha256(b"hello\n").hexdigest()}
    found = manifest.read(d)
    manifest.verify(d, found)
    damaged = bytearray(data)
    damaged[2500] ^= 1
    (d / "big.bin").write_bytes(bytes(damaged))
    with pytest.raises(manifest.ManifestMismatch, match=r"big\.bin: bytes 2000-2999: sha256 "):
        manifest.verify(d, found)
    (d / "big.bin").write_bytes(data)
    bad = {**found, "files": {**found["files"], "big.bin": {**found["files"]["big.bin"], "chunk_bytes": 0}}}
    with pytest.raises(manifest.ManifestMismatch, match="chunk_bytes is 0, not a positive integer"):
        manifest.verify(d, bad)
    for broken in ({"bytes": len(data), "chunk_bytes": 1000}, {"bytes": len(data)}, "x"):
        with pytest.raises(manifest.ManifestMismatch, match=r"unreadable entry for big\.bin"):
            manifest.verify(d, {**found, "files": {**found["files"], "big.bin": broken}})


def test_a_manifest_with_whole_file_digests_still_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint written before chunking lists a large file's SHA-256 over all of it."""
    d = _big_dir(tmp_path)
    old = manifest.write(d)  # CHUNK is 256 MiB: both files whole
    monkeypatch.setattr(manifest, "CHUNK", 1000)
    manifest.verify(d, {"files": old})
    (d / "big.bin").write_bytes(b"x" + (d / "big.bin").read_bytes()[1:])
    with pytest.raises(manifest.ManifestMismatch, match=r"big\.bin: sha256 "):
        manifest.verify(d, {"files": old})


def test_state_tensors_go_to_state_safetensors_and_come_back_where_they_were(tmp_path: Path) -> None:
    shared = torch.randn(4, 3)
    param = torch.nn.Parameter(torch.ones(2))
    master = torch.randn(5).requires_grad_()  # as DeepSpeed's fp32 master groups are
    state = {
        "actor_trainer": {"state": {0: {"exp_avg": shared, "exp_avg_sq": torch.rand(4, 3), "step": torch.tensor(7.0)}},
                          "param_groups": [{"lr": 1e-4, "params": [0]}]},
        "sched": collections.OrderedDict(last=(shared, torch.arange(5))),
        "param": param, "fp32_groups": [[master]], "data_cursor": 12, "version": 3, "digest": "abc",
    }
    actor = torch.nn.Linear(3, 4)
    path = ckpt.save_checkpoint(tmp_path, 3, actor=actor, critic=None, state=state)
    assert sorted(p.name for p in path.iterdir()) == ["actor.safetensors", "manifest.json", "state.pt",
                                                      "state.safetensors"]
    stored = load_file(str(path / "state.safetensors"))
    assert "actor_trainer.state.0.exp_avg" in stored and "sched.last[0]" not in stored  # the same tensor once
    loaded = ckpt.load_checkpoint(path)
    assert ckpt.first_difference({k: loaded[k] for k in state}, state) is None
    assert loaded["sched"]["last"][0] is loaded["actor_trainer"]["state"][0]["exp_avg"]
    assert type(loaded["sched"]) is collections.OrderedDict and type(loaded["sched"]["last"]) is tuple
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["fp32_groups"][0][0].requires_grad
    assert {"param", "fp32_groups[0][0]"} <= set(stored)  # in the tensor file, not the pickle
    _equal_bits(loaded["actor"], dict(actor.state_dict()))


def test_a_format_2_checkpoint_still_loads(tmp_path: Path) -> None:
    """Written before the state's tensors had their own file: everything in state.pt's pickle."""
    state = {"actor_trainer": {"m": torch.randn(6)}, "data_cursor": 1, "version": 1, "digest": "d"}
    actor = torch.nn.Linear(2, 2)
    path = ckpt.checkpoint_dir(tmp_path, 1)
    path.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in actor.state_dict().items()}, str(path / "actor.safetensors"))
    torch.save({**state, "update": 1, "format": 2}, path / "state.pt")
    manifest.write(path, format=2, update=1)
    loaded = ckpt.load_checkpoint(path)
    assert ckpt.first_difference(loaded["actor_trainer"], state["actor_trainer"]) is None


def test_state_pt_naming_a_tensor_the_file_lacks_is_corrupt(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 1, actor=torch.nn.Linear(2, 2), critic=None,
                                state={"m": torch.ones(3), "version": 1, "digest": "d"})
    tensorfile.save({"other": torch.ones(3)}, path / "state.safetensors")
    manifest.write(path, format=ckpt.FORMAT, update=1)  # consistent bytes, inconsistent contents
    with pytest.raises(ckpt.CheckpointCorrupt, match="has no tensor 'm', which state.pt refers to"):
        ckpt.load_checkpoint(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_write_through_pinned_staging_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorfile, "PIECE", 4096)  # many pieces per tensor, staging buffers reused
    tensors = {**_tensors("cuda"), "large": torch.randn(3, 100_003, device="cuda")}
    tensorfile.save(tensors, tmp_path / "g.safetensors")
    _equal_bits(tensors, load_file(str(tmp_path / "g.safetensors")))
    state = {"opt": {"m": torch.randn(50_000, device="cuda")}, "version": 1, "digest": "d"}
    path = ckpt.save_checkpoint(tmp_path, 1, actor=torch.nn.Linear(4, 4).cuda(), critic=None, state=state)
    loaded = ckpt.load_checkpoint(path)
    assert loaded["opt"]["m"].device == state["opt"]["m"].device
    assert ckpt.first_difference(loaded["opt"], state["opt"]) is None


def test_a_background_checkpoint_writes_on_its_own_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next update's publication must never queue behind a background checkpoint's pieces."""
    seen: dict[str, set[str]] = {}
    real = tensorfile._write_cpu

    def recording(fd: int, flat: torch.Tensor, start: int, stop: int, offset: int) -> None:
        seen.setdefault(lane, set()).add(threading.current_thread().name.rsplit("_", 1)[0])
        real(fd, flat, start, stop, offset)

    monkeypatch.setattr(tensorfile, "_write_cpu", recording)
    actor = torch.nn.Linear(8, 8)
    lane = "in line"
    ckpt.save_checkpoint(tmp_path / "a", 1, actor=actor, critic=None, state={"m": torch.ones(4)})
    lane = "background"
    writer = ckpt.CheckpointWriter(tmp_path / "b")
    writer.submit(1, ckpt.capture(1, actor=actor, critic=None, state={"m": torch.ones(4)}))
    writer.wait()
    assert seen == {"in line": {"hobson-foreground"}, "background": {"hobson-background"}}
    with bytepool.background():
        back = bytepool.pool()
    assert back is not bytepool.pool() and back._max_workers <= bytepool.pool()._max_workers


def test_the_pool_uses_no_more_threads_than_the_stage_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    mine = len(os.sched_getaffinity(0))
    monkeypatch.setenv("HOBSON_CPUS", "1")
    assert bytepool.workers() == 1
    monkeypatch.setenv("HOBSON_CPUS", "999")
    assert bytepool.workers() == min(16, mine)
    monkeypatch.delenv("HOBSON_CPUS")
    assert bytepool.workers() == min(16, mine)
