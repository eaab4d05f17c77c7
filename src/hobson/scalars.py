"""TensorBoard event files beside the JSONL a run writes: ``tensorboard --logdir runs/<id>``.

:class:`TensorBoardLog` writes every number of a metrics row as one scalar (nested dicts, such as
the RL's per-phase seconds, become ``seconds/rollout``). A resumed run opens its writer with
``purge_step`` set to the first step after its checkpoint, so TensorBoard drops what the
interrupted process wrote past it and no step appears twice. Only the caller's rank 0 writes.
Without the ``tensorboard`` package (a dependency of the train and rl extras) it says so once
and writes nothing: the JSONL stays the record.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_warned = False


def flat_scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``row`` by TensorBoard tag; booleans, strings and lists are not scalars."""
    out: dict[str, float] = {}
    for k, v in row.items():
        tag = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_scalars(v, f"{tag}/"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[tag] = float(v)
    return out


class TensorBoardLog:
    def __init__(self, log_dir: str | os.PathLike, purge_step: int | None = None) -> None:
        global _warned
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch raises this when the tensorboard package is missing
            if not _warned:
                print("[hobson] tensorboard is not installed (pip install tensorboard): no event files",
                      file=sys.stderr, flush=True)
                _warned = True
            self.writer = None
            return
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    @classmethod
    def off(cls) -> TensorBoardLog:
        """A log that writes nothing (ranks other than 0)."""
        log = cls.__new__(cls)
        log.writer = None
        return log

    def add(self, step: int, row: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
        if self.writer is None:
            return
        from hobson.io import disk_full_is_an_error

        with disk_full_is_an_error(self.writer.get_logdir()):  # name the event files' directory
            for tag, value in flat_scalars({k: v for k, v in row.items() if k not in skip}).items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()  # a killed run keeps every step it logged

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
