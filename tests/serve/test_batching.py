"""The batcher's worker on its own: no model, no HTTP."""

from __future__ import annotations

import threading

import pytest

from hobson.serve.batching import Batcher, Question


@pytest.mark.parametrize("fails", [False, True], ids=["answered", "failed"])
def test_a_forward_is_counted_before_its_requests_get_their_answers(fails: bool) -> None:
    """A client that reads the stats right after its reply must see its own forward: the worker
    counts it (and frees its queue places) first. Each delivery records the stats it saw."""

    def answer(rows: list[dict]) -> list[int]:
        if fails:
            raise RuntimeError("the forward failed")
        return [r["i"] for r in rows]

    batcher = Batcher(answer, max_batch_tokens=64, max_queue=8, wait_s=0.0)
    seen: list[tuple] = []
    done = threading.Event()

    def deliver(a: object, e: BaseException | None) -> None:
        s = batcher.stats
        seen.append((a, type(e).__name__ if e else None, s.forwards, s.questions, s.failed_forwards, batcher.held()))
        if len(seen) == 2:
            done.set()

    batcher.start()
    batcher.submit([Question({"i": 0}, 4, deliver), Question({"i": 1}, 4, deliver)])
    assert done.wait(30)
    batcher.stop(30)
    if fails:
        assert seen == [(None, "RuntimeError", 1, 2, 1, 0)] * 2
    else:
        assert seen == [(0, None, 1, 2, 0, 0), (1, None, 1, 2, 0, 0)]
