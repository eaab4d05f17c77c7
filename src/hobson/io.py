"""Atomic writes, digests and JSONL reading with ``file:line`` errors.

Every output in hobson is written through :func:`atomic_write` (temp file in the same
directory, fsync, rename) or, for a directory, :func:`atomic_dir`, so a failed or killed stage
never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

from hobson.errors import DataError

_CHUNK = 1 << 20
_UMASK = os.umask(0)
os.umask(_UMASK)
_ROW_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "))


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside ``path``; rename it over ``path`` only if the block succeeds."""
    path = Path(path)
    # a full disk names this file (a bare write error carries no filename: the user would see "a write")
    with disk_full_is_an_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": "\n"})) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs are shared like any file
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def fsync_files(directory: str | os.PathLike) -> None:
    """fsync every file under ``directory``: its bytes are on the disk before a rename publishes it.
    The files are flushed in parallel (a disk queues several flushes better than one at a time)."""
    from hobson import bytepool

    def flush(f: Path) -> None:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())

    list(bytepool.pool().map(flush, [f for f in sorted(Path(directory).rglob("*")) if f.is_file()]))


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, *, exists: Literal["replace", "keep"] = "replace",
               mode: int | None = None) -> Iterator[Path]:
    """Build the directory ``target`` in a hidden temporary sibling (yielded); when the block
    succeeds, fsync its files and rename it into place. On failure the sibling goes, ``target``
    stays as it was.

    ``exists="replace"``: an existing ``target`` is replaced (moved aside first: a rename cannot
    replace a non-empty directory). ``exists="keep"``: a ``target`` another process renamed into
    place meanwhile wins and this copy is discarded (concurrent builders of the same bytes).
    ``mode``: the directory's permissions (mkdtemp makes it private).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        fsync_files(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        if exists == "keep":
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.exists():
                    raise
            return
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.rename(target, old / "x")
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)


@contextlib.contextmanager
def disk_full_is_an_error(target: str | os.PathLike, need_bytes: int | None = None) -> Iterator[None]:
    """Turn "No space left on device" while writing ``target`` into one :class:`DiskFull` naming
    the path, the bytes it needs and those free (the writer's temporary sibling is already gone:
    :func:`atomic_dir` and the publication writer remove it on any failure)."""
    import errno

    try:
        yield
    except Exception as e:
        # safetensors raises its own error type for the same errno 28
        if not ((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
                or "No space left on device" in str(e) or "Disk quota exceeded" in str(e)):
            raise
        from hobson.errors import DiskFull

        probe = Path(target)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        st = os.statvfs(probe)
        free = st.f_bavail * st.f_frsize
        need = f"at least {need_bytes:,} bytes" if need_bytes else "more space"
        raise DiskFull(f"{target}: no space left on the device while writing it: it needs {need}, {free:,} bytes "
                       f"are free under {probe}; free space (or keep fewer checkpoints and publications), then "
                       "resume: nothing half-written was kept") from None


def check_writable_dir(path: str | os.PathLike, setting: str) -> None:
    """Fail before a stage spends any work if ``path`` cannot become a directory this user writes
    (its nearest existing ancestor is a file, or not writable): one ConfigError naming ``setting``.
    Creates nothing, so a stage refused for another reason leaves no trace."""
    from hobson.errors import ConfigError

    path = Path(path).absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{setting} {path}: {probe} is a file, not a directory; choose another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting} {path}: {probe} is not writable by this user; choose a directory you can "
                          "write, or fix its permissions")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def count_lines(path: str | os.PathLike) -> int:
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            n += chunk.count(b"\n")
    return n


def dumps_row(row: Any) -> str:
    """The one JSONL serialisation: compact, key order as given, UTF-8, no trailing spaces."""
    return _ROW_ENCODER.encode(row)


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, object)``; a line that is not JSON raises ``file:line: ...``."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                raise DataError(f"{path}:{lineno}: empty line")
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    return [obj for _, obj in iter_jsonl(path)]
