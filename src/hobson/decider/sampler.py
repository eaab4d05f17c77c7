"""Length-grouped batching with a resumable cursor, and the split of a step over DDP ranks.

The one-process schedule defines everything: epoch ``e`` shuffles the row indices with
``default_rng([seed, e])``, cuts them into chunks of ``micro_batch_size * chunk`` rows, sorts
each chunk longest first (ties by index), cuts it into micro-batches of ``micro_batch_size``
rows, shuffles the micro-batch order, and groups consecutive micro-batches into optimizer
steps of ``grad_accum`` (an epoch's last step may hold fewer). Steps never cross an epoch.
The plan is a pure function of ``(seed, epoch, lengths)``, so the cursor ``(epoch, step)`` is all
a checkpoint needs.

Under DDP every rank computes the same plan and :func:`assign_micro_batches` hands each of a
step's micro-batches, whole, to one rank; no rank ever forwards more than one micro-batch at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np


def row_length(row: Mapping[str, Any]) -> int:
    """A cheap, tokenizer-free length proxy: characters of the rendered prompt (``length_group_by: chars``)."""
    opts = sum(len(name) + len(desc) + 5 for name, desc in row["options"])
    return len(row["state"]) + len(row["instructions"]) + opts + 10


class LengthGroupedSampler:
    """Optimizer steps of micro-batches of row indices, epoch after epoch, from a cursor."""

    def __init__(self, lengths: Sequence[int], *, micro_batch_size: int, grad_accum: int, epochs: int,
                 seed: int, chunk: int = 64) -> None:
        if not lengths:
            raise ValueError("no training rows")
        self.lengths = list(lengths)
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.epochs = epochs
        self.seed = seed
        self.chunk = chunk
        self.epoch = 0
        self.step = 0  # next step within self.epoch
        self._plans: dict[int, list[list[list[int]]]] = {}

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """``steps[s][m]`` = row indices of micro-batch ``m`` of step ``s`` of ``epoch``."""
        if epoch not in self._plans:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(self.lengths)).tolist()
            size = self.micro_batch_size * self.chunk
            micro: list[list[int]] = []
            for start in range(0, len(order), size):
                chunk = sorted(order[start: start + size], key=lambda i: (-self.lengths[i], i))
                micro.extend(chunk[k: k + self.micro_batch_size] for k in range(0, len(chunk), self.micro_batch_size))
            micro = [micro[k] for k in rng.permutation(len(micro)).tolist()]
            self._plans = {epoch: [micro[k: k + self.grad_accum] for k in range(0, len(micro), self.grad_accum)]}
        return self._plans[epoch]

    def steps_per_epoch(self) -> int:
        return len(self.plan(0))  # every epoch cuts the same row count the same way

    def total_steps(self) -> int:
        return self.steps_per_epoch() * self.epochs

    def global_step(self) -> int:
        """Optimizer steps already taken before the cursor."""
        return self.epoch * self.steps_per_epoch() + self.step

    def __iter__(self) -> Iterator[tuple[int, int, list[list[int]]]]:
        """Yield ``(epoch, step in epoch, micro-batches)`` from the cursor; call :meth:`advance` after each."""
        while self.epoch < self.epochs:
            steps = self.plan(self.epoch)
            if self.step >= len(steps):
                self.epoch, self.step = self.epoch + 1, 0
                continue
            epoch, step = self.epoch, self.step
            yield epoch, step, steps[step]
            if (self.epoch, self.step) == (epoch, step):
                raise RuntimeError("LengthGroupedSampler: advance() was not called after a step")

    def advance(self) -> None:
        self.step += 1
        if self.step >= len(self.plan(self.epoch)):
            self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "rows": len(self.lengths)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["rows"] != len(self.lengths) or state["seed"] != self.seed:
            raise ValueError(f"sampler state is for {state['rows']} rows with seed {state['seed']}, "
                             f"this run has {len(self.lengths)} rows with seed {self.seed}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def assign_micro_batches(costs: Sequence[int], world: int) -> list[int]:
    """Owner rank of each micro-batch: longest-first greedy onto the least-loaded rank.

    ``costs`` are padded sizes (rows x longest row). Ties go to the lower rank and the lower
    micro-batch index, so every rank computes the same assignment. A rank may get none.
    """
    load = [0] * world
    owner = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += costs[k]
    return owner
