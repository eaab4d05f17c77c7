"""SHA256SUMS files: each stage's own, and the repository's committed ``data/SHA256SUMS``.

Format (as ``sha256sum`` writes and ``sha256sum -c`` reads from the data dir)::

    <64 hex>  <path relative to the data dir>

A stage writes ``D/<stage dir>/SHA256SUMS`` last, so its presence means the stage finished.
The stage dir of a relpath is its first component (``build/train.jsonl`` -> ``D/build``;
``fetch`` writes under ``D/raw``).

``data/SHA256SUMS`` pins the embedded default corpus (generator, seed 0, scale 1). It is
written only by ``python -m jobs.<stage> --write-sums``, never by a normal build.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from hobson.errors import DataError, DigestMismatch, StageError
from hobson.io import sha256_file, write_text_atomic

SUMS_NAME = "SHA256SUMS"
SOURCE_NAME = "SOURCE"
DEFAULT_SEED = 0
DEFAULT_SCALE = 1.0

_LINE = re.compile(r"^([0-9a-f]{64})  (\S.*)$")


def source_line_generator(seed: int, scale: float) -> str:
    return f"generator seed={seed} scale={scale:g}"


DEFAULT_SOURCE = source_line_generator(DEFAULT_SEED, DEFAULT_SCALE)


def committed_sums_path() -> Path:
    """``data/SHA256SUMS`` of the source checkout (repo root = parent of ``src/hobson``)."""
    return Path(__file__).resolve().parents[3] / "data" / SUMS_NAME


def read_sums(path: str | os.PathLike) -> dict[str, str]:
    """relpath -> hex digest; a malformed line raises ``file:line: ...``."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            m = _LINE.match(line)
            if not m:
                raise DataError(f"{path}:{lineno}: expected '<64 hex>  <relpath>', got {line!r}")
            out[m.group(2)] = m.group(1)
    return out


def format_sums(digests: dict[str, str]) -> str:
    return "".join(f"{digests[rel]}  {rel}\n" for rel in sorted(digests))


def write_sums(path: str | os.PathLike, digests: dict[str, str]) -> None:
    write_text_atomic(path, format_sums(digests))


def stage_dir_of(relpath: str) -> str:
    return relpath.split("/", 1)[0]


def regenerate_command(stage: str) -> str:
    return f"python -m jobs.{stage} --write-sums"


def check_committed(stage: str, digests: dict[str, str], data_dir: Path) -> None:
    """Compare a default build's fresh digests with ``data/SHA256SUMS``; raise on drift.

    Skipped when the file is absent (a non-editable install carries no ``data/``).
    """
    committed_path = committed_sums_path()
    if not committed_path.is_file():
        return
    committed = read_sums(committed_path)
    for rel in sorted(digests):
        expected = committed.get(rel)
        if expected != digests[rel]:
            raise DigestMismatch(
                f"{data_dir / rel}: the default corpus drifted from {committed_path}: expected sha256 "
                f"{expected or '(not listed)'}, got {digests[rel]}. If the generator change is intended, "
                f"regenerate the committed digests with `{regenerate_command(stage)}` and commit "
                f"data/{SUMS_NAME}."
            )


def update_committed(digests: dict[str, str], stage_dir: str) -> Path:
    """Replace the lines of one stage dir in ``data/SHA256SUMS``, keeping the others."""
    path = committed_sums_path()
    current = read_sums(path) if path.is_file() else {}
    kept = {rel: d for rel, d in current.items() if stage_dir_of(rel) != stage_dir}
    kept.update(digests)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_sums(path, kept)
    return path


def _is_default(data_dir: Path, stage_dir: str) -> bool:
    source = data_dir / stage_dir / SOURCE_NAME
    return source.is_file() and source.read_text(encoding="utf-8").strip() == DEFAULT_SOURCE


def verify_corpus(data_dir: str | os.PathLike, relpaths: Iterable[str] | None = None) -> dict[str, str]:
    """Check corpus files against their stage's SHA256SUMS (and, for the default, ``data/``).

    ``relpaths`` are relative to ``data_dir`` (``"build/train.jsonl"``); ``None`` checks every
    file listed by every stage SHA256SUMS under ``data_dir``. Returns relpath -> sha256.
    Raises ``DigestMismatch`` naming the file, expected and actual digest; ``StageError`` when
    a file or its stage's SHA256SUMS is missing.
    """
    data_dir = Path(data_dir)
    if relpaths is None:
        relpaths = [rel for sums in sorted(data_dir.glob(f"*/{SUMS_NAME}")) for rel in read_sums(sums)]
    committed_path = committed_sums_path()
    committed = read_sums(committed_path) if committed_path.is_file() else None
    out: dict[str, str] = {}
    for rel in relpaths:
        stage_dir = stage_dir_of(rel)
        sums_path = data_dir / stage_dir / SUMS_NAME
        if not sums_path.is_file():
            raise StageError(f"{sums_path}: missing, so {data_dir / rel} is unverified (run its stage first)")
        recorded = read_sums(sums_path)
        if rel not in recorded:
            raise StageError(f"{data_dir / rel}: not listed in {sums_path}")
        path = data_dir / rel
        if not path.is_file():
            raise StageError(f"{path}: missing (listed in {sums_path})")
        actual = sha256_file(path)
        if actual != recorded[rel]:
            raise DigestMismatch(
                f"{path}: sha256 mismatch: expected {recorded[rel]} (from {sums_path}), actual {actual}"
            )
        if committed is not None and _is_default(data_dir, stage_dir):
            expected = committed.get(rel)
            if expected is not None and expected != actual:
                raise DigestMismatch(
                    f"{path}: sha256 mismatch: expected {expected} (committed in {committed_path}), "
                    f"actual {actual}"
                )
        out[rel] = actual
    return out
