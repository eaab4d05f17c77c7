"""Collator draws, skip, truncation; length-grouped sampler and rank assignment."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from hobson.decider.collate import Collator, to_canonical, token_lengths
from hobson.decider.sampler import LengthGroupedSampler, assign_micro_batches, row_length
from hobson.errors import DataError
from hobson.io import read_jsonl


@pytest.fixture(scope="module")
def tok_rows(decider_data):
    return AutoTokenizer.from_pretrained(decider_data["torso"]), read_jsonl(decider_data["train"])


def test_skip_advances_rng_exactly_like_collate(tok_rows):
    tok, rows = tok_rows
    a = Collator(tok, max_length=128, force_bos=False, seed=7)
    b = Collator(tok, max_length=128, force_bos=False, seed=7)
    first = list(enumerate(rows))[:11]
    a.collate(first)
    b.skip(first)
    assert a.state_dict() == b.state_dict()
    nxt = list(enumerate(rows))[11:20]
    assert a.collate(nxt).token_ids == b.collate(nxt).token_ids
    c = Collator(tok, max_length=128, force_bos=False, seed=7)
    c.load_state_dict(a.state_dict())
    more = list(enumerate(rows))[20:]
    assert c.collate(more).token_ids == a.collate(more).token_ids


def test_draws_reshuffle_options_and_phrasing(tok_rows):
    tok, rows = tok_rows
    col = Collator(tok, max_length=10_000, force_bos=True, seed=0)
    row = (2, rows[2])  # three phrasings (instructions + 2 variants), options of a choice row
    texts = set()
    orders = set()
    for _ in range(30):
        batch = col.collate([row])
        assert batch.input_ids[0, 0] == tok.bos_token_id
        texts.add(tok.decode(batch.token_ids[0]))
        orders.add(tuple(batch.perm[0].tolist()))
    assert len(orders) > 1
    assert all(any(p in t for t in texts) for p in [rows[2]["instructions"], *rows[2]["instruction_variants"]])
    fixed = Collator(tok, max_length=10_000, force_bos=False, seed=0, shuffle=False)
    assert fixed.collate([row]).perm[0].tolist() == list(range(len(rows[2]["options"])))


def test_key_and_answer_positions_and_canonical_order(tok_rows):
    tok, rows = tok_rows
    col = Collator(tok, max_length=10_000, force_bos=False, seed=1)
    batch = col.collate(list(enumerate(rows[:4])))
    for b, (_, row) in enumerate(enumerate(rows[:4])):
        ids = batch.token_ids[b]
        assert tok.decode(ids).endswith("\nAnswer:") and batch.answer_pos[b] == len(ids) - 1
        for j in range(int(batch.option_mask[b].sum())):
            name, desc = row["options"][int(batch.perm[b, j])]
            upto = tok.decode(ids[: int(batch.option_pos[b, j]) + 1])
            assert upto.endswith(f"{chr(65 + j)}. {name}: {desc}" if desc else f"{chr(65 + j)}. {name}")
    x = torch.tensor([[10.0, 20.0, 30.0]])
    assert to_canonical(x, torch.tensor([[2, 0, 1]])).tolist() == [[20.0, 30.0, 10.0]]


def test_long_state_is_cut_from_the_left_never_the_options(tok_rows):
    tok, rows = tok_rows
    row = dict(rows[1], state="first words " + "stone " * 200 + "the last words")
    short = Collator(tok, max_length=10_000, force_bos=False, seed=0, shuffle=False)
    room = len(short.collate([(0, dict(row, state="the last words"))]).token_ids[0]) + 20
    col = Collator(tok, max_length=room, force_bos=False, seed=0, shuffle=False)
    batch = col.collate([(0, row)])
    text = tok.decode(batch.token_ids[0])
    assert len(batch.token_ids[0]) == room
    assert "first words" not in text and "the last words" in text
    assert text.endswith(tok.decode(short.collate([(0, dict(row, state="x"))]).token_ids[0])[1:])
    with pytest.raises(DataError, match="training row 0: instruction and options take .* more than max_length 20"):
        Collator(tok, max_length=20, force_bos=False, seed=0).collate([(0, row)])


def test_sampler_plan_covers_every_row_once_per_epoch():
    lengths = [(i * 37) % 101 for i in range(40)]
    s = LengthGroupedSampler(lengths, micro_batch_size=3, grad_accum=3, epochs=2, seed=0, chunk=4)
    plans = [s.plan(e) for e in range(2)]
    for plan in plans:
        flat = [i for step in plan for mb in step for i in mb]
        assert sorted(flat) == list(range(40))
        assert all(len(mb) <= 3 for step in plan for mb in step)
        assert all(1 <= len(step) <= 3 for step in plan)
        # within a micro-batch rows are length-sorted (longest first)
        assert all([lengths[i] for i in mb] == sorted((lengths[i] for i in mb), reverse=True)
                   for step in plan for mb in step)
    assert plans[0] != plans[1]
    assert s.total_steps() == 10


def test_sampler_cursor_resumes_the_same_schedule():
    lengths = list(range(25))
    full = LengthGroupedSampler(lengths, micro_batch_size=2, grad_accum=2, epochs=3, seed=4, chunk=2)
    seen = []
    for item in full:
        seen.append(item)
        full.advance()
    part = LengthGroupedSampler(lengths, micro_batch_size=2, grad_accum=2, epochs=3, seed=4, chunk=2)
    it = iter(part)
    for _ in range(9):
        next(it)
        part.advance()
    fresh = LengthGroupedSampler(lengths, micro_batch_size=2, grad_accum=2, epochs=3, seed=4, chunk=2)
    fresh.load_state_dict(part.state_dict())
    rest = []
    for item in fresh:
        rest.append(item)
        fresh.advance()
    assert seen[9:] == rest and len(seen) == full.total_steps()


def test_assign_micro_batches_balances_and_leaves_spare_ranks_idle():
    assert assign_micro_batches([10, 30, 20], 2) == [1, 0, 1]
    assert assign_micro_batches([10, 30, 20], 4) == [2, 0, 1]  # rank 3 has nothing this step
    assert assign_micro_batches([5, 5, 5, 5], 3) == [0, 1, 2, 0]


def test_row_length_grows_with_content(tok_rows):
    _, rows = tok_rows
    r = rows[0]
    assert row_length(dict(r, state=r["state"] + " more")) > row_length(r)


def test_token_lengths_are_the_canonical_rendering_and_draw_no_rng(tok_rows):
    tok, rows = tok_rows
    lengths = token_lengths(tok, rows, max_length=1024, force_bos=False, chunk=7)  # chunks: 7 rows at a time
    canonical = Collator(tok, max_length=1024, force_bos=False, seed=0, shuffle=False).collate(list(enumerate(rows)))
    assert lengths == canonical.attention_mask.sum(dim=1).tolist()
    drawn = Collator(tok, max_length=1024, force_bos=False, seed=5).collate(list(enumerate(rows)))
    drawn_lengths = drawn.attention_mask.sum(dim=1).tolist()
    plain = [i for i, r in enumerate(rows) if not r.get("instruction_variants")]  # only the order is drawn
    assert plain and all(drawn_lengths[i] == lengths[i] for i in plain)
    longest = max(range(len(rows)), key=lengths.__getitem__)  # its state is cut as in training
    assert token_lengths(tok, [rows[longest]], max_length=lengths[longest] - 5, force_bos=False) == [
        lengths[longest] - 5]


def test_grouping_by_tokens_pads_less_than_by_characters(tok_rows):
    tok, rows = tok_rows
    tokens = token_lengths(tok, rows, max_length=1024, force_bos=False)

    def padding(lengths):
        plan = LengthGroupedSampler(lengths, micro_batch_size=4, grad_accum=1, epochs=1, seed=0, chunk=8).plan(0)
        real = sum(tokens[i] for step in plan for mb in step for i in mb)
        padded = sum(len(mb) * max(tokens[i] for i in mb) for step in plan for mb in step)
        return 1 - real / padded

    assert padding(tokens) < padding([row_length(r) for r in rows])


def test_idle_ranks_are_those_assign_micro_batches_leaves_without_work():
    """The DDP recipe's warning counts the ranks a step leaves idle: whole micro-batches go to
    ranks, so with fewer micro-batches than ranks the rest wait (8 GPUs, grad_accum 2: six)."""
    from hobson.decider.train import idle_ranks

    for world in (2, 3, 8):
        for accum in (1, 2, 3, 8, 16):
            owners = assign_micro_batches([100 + k for k in range(accum)], world)
            assert idle_ranks(world, accum) == world - len(set(owners)), (world, accum)
    assert idle_ranks(8, 2) == 6 and idle_ranks(8, 8) == 0


def test_a_batch_is_built_in_as_many_torch_ops_whatever_its_rows(tok_rows):
    """The collator turns each field's Python lists into a tensor once: per-row writes were a
    dozen torch ops a row, host time a GPU idles through at each step's start. Rows with and
    without a teacher, and of different lengths, in both batches."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Census(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    tok, rows = tok_rows
    assert len(rows) >= 40
    teacher = {i: [1.0 / len(r["options"])] * len(r["options"]) for i, r in enumerate(rows) if i % 3}
    counts = []
    for n in (4, 40):
        col = Collator(tok, max_length=128, force_bos=False, seed=0, teacher=teacher)
        with Census() as census:
            batch = col.collate(list(enumerate(rows))[:n])
        assert batch.input_ids.shape[0] == n and batch.has_teacher.sum().item() == sum(1 for i in range(n) if i % 3)
        counts.append(sum(census.ops.values()))
    assert counts[0] == counts[1] and counts[0] <= 40, counts
