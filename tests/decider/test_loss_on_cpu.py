"""Reference cases for the decider loss: hand-computed values and a per-row loop version."""

from __future__ import annotations

import math

import pytest
import torch

from hobson.decider.loss import KL_FLOOR, decider_loss, ordinal_targets


def _targets(label: int, n: int, eps: float, score: bool) -> list[float]:
    return ordinal_targets(torch.tensor([label]), torch.tensor([n]), n, eps, torch.tensor([score]))[0].tolist()


def test_ordinal_smoothing_spreads_eps_to_neighbours():
    assert _targets(2, 5, 0.1, True) == pytest.approx([0, 0.05, 0.9, 0.05, 0])
    assert _targets(0, 5, 0.1, True) == pytest.approx([0.9, 0.1, 0, 0, 0])  # one neighbour takes all eps
    assert _targets(4, 5, 0.1, True) == pytest.approx([0, 0, 0, 0.1, 0.9])
    assert _targets(0, 1, 0.1, True) == [1.0]  # nothing to smooth into
    assert _targets(2, 5, 0.1, False) == [0, 0, 1, 0, 0]  # choice/noul rows stay one-hot


def test_ordinal_smoothing_ce_value():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, m = decider_loss(logits, mask, torch.tensor([2]), torch.tensor([True]), torch.tensor([2.0]), score_eps=0.1)
    logz = math.log(sum(math.exp(x) for x in range(5)))
    ce = -(0.05 * (1 - logz) + 0.9 * (2 - logz) + 0.05 * (3 - logz))
    assert float(loss) == pytest.approx(2.0 * ce, rel=1e-6)
    assert float(m["ce"]) == pytest.approx(2.0 * ce, rel=1e-6)


def test_reverse_kl_floors_target_and_stays_finite():
    logits = torch.zeros(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    teacher = torch.tensor([[1.0, 0.0, 0.0]])
    args = (logits, mask, torch.tensor([0]), torch.tensor([False]), torch.tensor([0.0]), teacher, torch.tensor([True]))
    rev, m = decider_loss(*args, kl_teacher_weight=1.0, kl_direction="reverse")
    z = 1 + 2 * KL_FLOOR
    expected = (1 / 3) * (math.log(1 / 3) - math.log(1 / z)) + (2 / 3) * (math.log(1 / 3) - math.log(KL_FLOOR / z))
    assert float(rev) == pytest.approx(expected, rel=1e-5)
    fwd, _ = decider_loss(*args, kl_teacher_weight=1.0, kl_direction="forward")
    assert float(fwd) == pytest.approx(math.log(3), rel=1e-6)


def test_kl_only_rows_have_no_ce_but_train_on_kl():
    logits = torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.2, 0.0]], requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    teacher = torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.0, 0.0]])
    has_teacher = torch.tensor([True, False])
    loss, m = decider_loss(logits, mask, torch.tensor([1, 2]), torch.tensor([False, False]), torch.tensor([0.0, 0.0]),
                           teacher, has_teacher, kl_teacher_weight=0.7)
    logp = torch.log_softmax(logits.detach()[0], -1)
    kl = float((teacher[0] * (teacher[0].log() - logp)).sum())
    assert float(m["ce"]) == 0.0
    assert float(loss.detach()) == pytest.approx(0.7 * kl, rel=1e-6)
    loss.backward()
    assert logits.grad[0].abs().sum() > 0  # the KL term trains the KL-only row
    assert torch.equal(logits.grad[1], torch.zeros(3))  # no weight, no teacher, no anchor: no signal


def _loop_loss(logits, mask, label, is_score, weight, teacher, has_teacher, frozen, eps, lt, lf, direction):
    total = 0.0
    for b in range(logits.shape[0]):
        n = int(mask[b].sum())
        logp = torch.log_softmax(logits[b, :n].double(), -1)
        y = [0.0] * n
        y[label[b]] = 1.0
        if is_score[b] and n > 1 and eps > 0:
            nbrs = [j for j in (label[b] - 1, label[b] + 1) if 0 <= j < n]
            y[label[b]] = 1 - eps
            for j in nbrs:
                y[j] += eps / len(nbrs)
        row = -weight[b] * sum(y[j] * float(logp[j]) for j in range(n))

        def kl(q, logp=logp, n=n):
            q = [float(x) for x in q]
            if direction == "forward":
                return sum(qj * (math.log(qj) - float(logp[j])) for j, qj in enumerate(q) if qj > 0)
            fl = [max(x, KL_FLOOR) for x in q]
            fl = [x / sum(fl) for x in fl]
            return sum(math.exp(float(logp[j])) * (float(logp[j]) - math.log(fl[j])) for j in range(n))
        if has_teacher[b]:
            row += lt * kl(teacher[b, :n])
        row += lf * kl(torch.softmax(frozen[b, :n].double(), -1))
        total += row
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_vectorised_loss_matches_loop(seed, direction):
    g = torch.Generator().manual_seed(seed)
    B, N = 6, 5
    n = torch.randint(1, N + 1, (B,), generator=g)
    mask = torch.arange(N)[None, :] < n[:, None]
    logits = torch.randn(B, N, generator=g) * 2
    frozen = torch.randn(B, N, generator=g)
    label = torch.stack([torch.randint(0, int(k), (1,), generator=g)[0] for k in n])
    is_score = torch.rand(B, generator=g) < 0.5
    weight = torch.tensor([0.0, 0.5, 1.0, 2.0, 1.0, 0.0])
    raw = torch.rand(B, N, generator=g).masked_fill(~mask, 0)
    raw[0, 0] = 0.0  # a zero teacher probability exercises 0 log 0 and the reverse floor
    teacher = raw / raw.sum(-1, keepdim=True).clamp(min=1e-9)
    has_teacher = torch.rand(B, generator=g) < 0.7
    loss, _ = decider_loss(logits, mask, label, is_score, weight, teacher, has_teacher, frozen, score_eps=0.1,
                           kl_teacher_weight=0.5, kl_frozen_weight=0.3, kl_direction=direction)
    ref = _loop_loss(logits, mask, label.tolist(), is_score.tolist(), weight.tolist(), teacher, has_teacher.tolist(),
                     frozen, 0.1, 0.5, 0.3, direction)
    assert float(loss) == pytest.approx(ref, rel=1e-5)
