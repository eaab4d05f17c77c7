"""The version digest (``publication.tensors_digest``) is one function of the bytes wherever it is
computed: numpy over pieces on the CPU and torch on a tensor's device agree bit for bit (GPU: in
tests/rl/test_engine_on_gpu.py), and any changed 32-bit word, dtype, shape or name changes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hobson.rollout import publication


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 7, generator=g), "h": torch.randn(5, generator=g).half(),  # 10 bytes: a tail
            "i": torch.arange(9, dtype=torch.int64), "b": torch.tensor([True, False, True]), "e": torch.zeros(0)}


@pytest.mark.parametrize("nbytes", [4, 40, 4096, 4 * 70_001])
def test_torch_and_numpy_give_the_same_piece_sums(nbytes: int) -> None:
    piece = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert publication._piece_sums_torch(piece).tolist() == publication._piece_sums_np(piece.numpy())


def test_the_piece_sums_are_the_defined_arithmetic() -> None:
    words = np.array([1, -1, 2**31 - 1, 7], dtype=np.int32)
    m = publication._multipliers_np(4).astype(np.int64)
    want = [int(sum(((int(w) * int(mk)) + 2**31) % 2**32 - 2**31 for w, mk in zip(words, row, strict=True)))
            for row in m]
    assert publication._piece_sums_np(words.view(np.uint8)) == want
    assert (m % 2 != 0).all()


def test_every_change_changes_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _tensors()
    d = publication.tensors_digest(base)
    assert d == publication.tensors_digest(dict(reversed(base.items())))  # name order, not dict order
    assert d == publication.tensors_digest(base, workers=1)
    for name in ("w", "h", "i"):
        t = base[name].clone()
        t.reshape(-1).view(torch.uint8)[-1] ^= 1
        assert publication.tensors_digest({**base, name: t}) != d, name
    assert publication.tensors_digest({**base, "w": base["w"].reshape(7, 300)}) != d
    assert publication.tensors_digest({**base, "i": base["i"].to(torch.float64)}) != d
    assert publication.tensors_digest({**{k: v for k, v in base.items() if k != "w"}, "v": base["w"]}) != d
    # pieces of a tensor larger than one piece: the same value when the pieces are small
    monkeypatch.setattr(publication, "DIGEST_CHUNK", 64)
    small = publication.tensors_digest(base)
    t = base["w"].clone()
    t.view(-1)[1000] += 1
    assert publication.tensors_digest({**base, "w": t}) != small


def test_the_device_path_reads_back_the_same_sums_as_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_device_sums`` is what a GPU runs (one read-back per device for all tensors); on CPU
    tensors it must give every tensor's piece sums exactly as the numpy path does, in order."""
    monkeypatch.setattr(publication, "DIGEST_CHUNK", 64)  # several pieces per tensor, a short last one
    base = _tensors()
    names = sorted(base)
    split = {n: publication._pieces(base[n]) for n in names}
    want = {n: [v for a, b in split[n][1] for v in publication._piece_sums_np(split[n][0][a:b].numpy())]
            for n in names if split[n][1]}
    got = publication._device_sums(split, names)
    assert got == want
    assert len(got["w"]) == 2 * -(-300 * 7 * 4 // 64)
