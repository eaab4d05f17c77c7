"""The bounded question queue and the one worker that answers it in shared forwards.

Requests put their questions in; the worker takes everything waiting, sorts it by rendered
length and cuts it into forwards whose padded size (rows x longest row) stays within
``max_batch_tokens``, so questions from concurrent requests share forwards and no forward can
exceed the cap that keeps the device's memory bounded. One worker, because one device runs one
forward at a time anyway and a second would only add contention.

The queue counts every question not yet answered (waiting or in the forward running now), so
"full" means the server already holds that much work: a request that would overflow it is
refused whole (:class:`QueueFull`, HTTP 429), never half queued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hobson import faults

Deliver = Callable[[Any, BaseException | None], None]  # (answer, error): one of them is None


class QueueFull(Exception):
    """The questions would take the queue over its bound; nothing of the request was queued."""


@dataclass
class Question:
    row: dict[str, Any]
    tokens: int  # rendered length: what it adds to a forward's padded width
    deliver: Deliver
    seq: int = 0  # arrival order, the tie-break among equal lengths


@dataclass
class Stats:
    """What the worker did; served by ``/healthz`` so tests and operators can see the batching."""

    forwards: int = 0
    questions: int = 0
    largest_forward_tokens: int = 0
    largest_forward_rows: int = 0
    failed_forwards: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def plan_forwards(tokens: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices into ``tokens``, shortest first, cut so that each group's ``len x max`` fits.

    Rows of similar length share a forward, so little of it is padding. Every single row must
    fit on its own (the server refuses longer questions before they are queued).
    """
    order = sorted(range(len(tokens)), key=lambda i: (tokens[i], i))
    groups: list[list[int]] = []
    for i in order:
        if tokens[i] > max_batch_tokens:
            raise ValueError(f"a question of {tokens[i]} tokens exceeds max_batch_tokens={max_batch_tokens}")
        # sorted ascending: the newcomer is the group's longest
        if groups and (len(groups[-1]) + 1) * tokens[i] <= max_batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class Batcher:
    """``answer(rows) -> answers`` runs one forward; the worker thread calls it per group."""

    answer: Callable[[list[dict[str, Any]]], list[Any]]
    max_batch_tokens: int
    max_queue: int
    wait_s: float = 0.002  # after the first question arrives: let its concurrent siblings join it
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[Question] = []
        self._held = 0  # questions queued or in the running forward
        self._seq = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="serve-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def held(self) -> int:
        with self._cond:
            return self._held

    def submit(self, questions: Sequence[Question]) -> None:
        """Queue all of ``questions`` or none (:class:`QueueFull`)."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self._held + len(questions) > self.max_queue:
                raise QueueFull(f"{self._held} questions are queued, the limit is {self.max_queue}")
            for q in questions:
                q.seq = self._seq
                self._seq += 1
            self._waiting.extend(questions)
            self._held += len(questions)
            self._cond.notify()

    def stop(self, timeout_s: float | None = None) -> None:
        """Answer what is queued, then end the worker (a clean shutdown loses no request)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _take(self) -> list[Question] | None:
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait()
            if not self._waiting:
                return None
        if self.wait_s:
            time.sleep(self.wait_s)
        with self._cond:
            taken, self._waiting = self._waiting, []
        return taken

    def _run(self) -> None:
        while (taken := self._take()) is not None:
            for group in plan_forwards([q.tokens for q in taken], self.max_batch_tokens):
                self._forward([taken[i] for i in group])

    def _forward(self, group: list[Question]) -> None:
        # TEST-ONLY: a fault test holds the forward here to fill the queue at a known moment
        faults.hold("serve-forward")
        tokens = len(group) * max(q.tokens for q in group)
        error: Exception | None = None
        try:
            answers = self.answer([q.row for q in group])
        except Exception as e:  # noqa: BLE001 - the forward's error goes to its requests, the server stays up
            error = e
        # the stats count this forward before any of its requests gets its answer: a client that
        # reads /health after its reply sees its own forward counted
        s = self.stats
        if error is not None:
            s.failed_forwards += 1
        s.forwards += 1
        s.questions += len(group)
        s.largest_forward_tokens = max(s.largest_forward_tokens, tokens)
        s.largest_forward_rows = max(s.largest_forward_rows, len(group))
        with self._cond:
            self._held -= len(group)
        if error is not None:
            for q in group:
                q.deliver(None, error)
        else:
            for q, a in zip(group, answers, strict=True):
                q.deliver(a, None)
