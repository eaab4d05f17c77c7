"""Progress of long loops: a tqdm bar in a terminal, plain periodic lines otherwise (Slurm logs).

    for update in progress(range(1, n + 1), total=n, desc="rl updates"): ...
    bar = Progress(total, "teacher shard 3"); bar.set(done)   # when the caller counts

A bar goes to stderr, so stdout (the JSON lines runs are compared by) stays as it was. Without a
terminal a line ``[hobson] <desc>: k/total (r/s, elapsed, left)`` is printed at most every
``every_s`` seconds, and once at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")
EVERY_S = 30.0


class Progress:
    def __init__(self, total: int | None, desc: str, *, every_s: float = EVERY_S, file: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.file = file or sys.stderr
        self.n = 0
        self.t0 = self._last = time.monotonic()
        use_tty = self.file.isatty() if tty is None else tty
        self._bar: Any = None
        if use_tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self.file, dynamic_ncols=True)

    def set(self, n: int) -> None:
        """``n`` items done so far."""
        if self._bar is not None:
            self._bar.update(n - self.n)
            self.n = n
            return
        self.n = n
        now = time.monotonic()
        if now - self._last >= self.every_s or (self.total is not None and n >= self.total):
            self._last = now
            self.file.write(self.line(now) + "\n")
            self.file.flush()

    def line(self, now: float | None = None) -> str:
        el = (now or time.monotonic()) - self.t0
        rate = self.n / el if el > 0 else 0.0
        of = f"/{self.total}" if self.total is not None else ""
        left = (f", {(self.total - self.n) / rate:.0f}s left" if self.total is not None and rate > 0
                and self.n < self.total else "")
        return f"[hobson] {self.desc}: {self.n}{of} ({rate:.3g}/s, {el:.0f}s{left})"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress(items: Iterable[T], total: int | None = None, desc: str = "", **kw: Any) -> Iterator[T]:
    """``items``, reporting each one done (see :class:`Progress`)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    bar = Progress(total, desc, **kw)
    try:
        for item in items:
            yield item
            bar.set(bar.n + 1)
    finally:
        bar.close()


def reporter(desc: str) -> Callable[[int, int], None]:
    """An ``on_batch(done, total)`` callback reporting through a :class:`Progress` (labelling)."""
    bar: list[Progress] = []

    def on_batch(done: int, total: int) -> None:
        if not bar:
            bar.append(Progress(total, desc))
        bar[0].set(done)
        if done >= total:
            bar[0].close()

    return on_batch
