"""Download raw sources listed in ``configs/fetch.yaml``: retries, resumed Range requests, digests.

A source is fetched into ``D/raw/.<name>.part`` and renamed to ``D/raw/<name>`` only after
its size and sha256 match the config. An interrupted transfer keeps the ``.part`` and the
next attempt (or the next run) asks for ``Range: bytes=<part size>-``; a server that ignores
the range and answers 200 restarts the file. A size or digest mismatch deletes the ``.part``:
nothing unverified is ever left under ``D/raw``.
"""

from __future__ import annotations

import http.client
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hobson.corpus.raw import FORMATS
from hobson.errors import ConfigError, DigestMismatch, StageError
from hobson.io import sha256_file

TOP_KEYS = ("sources",)
SOURCE_KEYS = ("name", "url", "size", "sha256", "format")
REQUIRED_KEYS = ("name", "url", "size", "sha256")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RESERVED = ("MANIFEST.json", "SHA256SUMS", "SOURCE")
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Source:
    name: str
    url: str
    size: int
    sha256: str
    format: str = ""

    def manifest_entry(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "size": self.size, "sha256": self.sha256,
                "format": self.format}


def load_fetch_config(path: str | os.PathLike) -> list[Source]:
    """Parse and check a fetch config; every problem is reported at once, naming the file."""
    import yaml  # here, not at module level: the generator stages need no YAML parser

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if doc is None:
        return []
    errors: list[str] = []
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with key 'sources', got {type(doc).__name__}")
    for key in doc:
        if key not in TOP_KEYS:
            errors.append(f"unknown key {key!r} (allowed: {', '.join(TOP_KEYS)})")
    entries = doc.get("sources") or []
    if not isinstance(entries, list):
        errors.append("'sources' must be a list")
        entries = []
    sources: list[Source] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"sources[{i}]"
        if not isinstance(entry, dict):
            errors.append(f"{where}: expected a mapping")
            continue
        for key in entry:
            if key not in SOURCE_KEYS:
                errors.append(f"{where}: unknown key {key!r} (allowed: {', '.join(SOURCE_KEYS)})")
        missing = [k for k in REQUIRED_KEYS if k not in entry]
        if missing:
            errors.append(f"{where}: missing key(s) {', '.join(missing)}")
            continue
        name, url, size, digest = entry["name"], entry["url"], entry["size"], entry["sha256"]
        fmt = entry.get("format", "")
        if not (isinstance(name, str) and _NAME.fullmatch(name)) or name in _RESERVED:
            errors.append(f"{where}: name {name!r} must be a plain file name (letters, digits, . _ -)")
        elif name in seen:
            errors.append(f"{where}: duplicate name {name!r}")
        seen.add(str(name))
        if not (isinstance(url, str) and re.match(r"^(https?|file)://", url)):
            errors.append(f"{where}: url {url!r} must start with http://, https:// or file://")
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
            errors.append(f"{where}: size must be a non-negative integer byte count, got {size!r}")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            errors.append(f"{where}: sha256 must be 64 lower-case hex digits, got {digest!r}")
        if fmt and fmt not in FORMATS:
            errors.append(f"{where}: format {fmt!r} is not one of {', '.join(FORMATS)} (or leave it out)")
        sources.append(Source(str(name), str(url), size, str(digest), str(fmt)))
    if errors:
        raise ConfigError(f"{path}: " + ("\n  ".join([""] + errors) if len(errors) > 1 else errors[0]))
    return sources


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _transfer(source: Source, part: Path, timeout_s: float) -> None:
    """One attempt: append to ``part`` from its current size (or restart if the server says 200)."""
    offset = part.stat().st_size if part.exists() else 0
    if offset >= source.size and offset:
        if offset > source.size:  # longer than the declared size: not resumable, start over
            part.unlink()
            offset = 0
        else:
            return
    req = urllib.request.Request(source.url)
    if offset:
        req.add_header("Range", f"bytes={offset}-")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        resumed = offset > 0 and getattr(resp, "status", None) == 206
        if resumed:
            content_range = resp.headers.get("Content-Range", "")
            if not content_range.startswith(f"bytes {offset}-"):
                raise StageError(f"{source.url}: asked for bytes {offset}-, server sent {content_range!r}")
        elif offset:
            _log(f"fetch: {source.name}: server ignored the Range request; restarting from byte 0")
        length = resp.headers.get("Content-Length")
        with open(part, "ab" if resumed else "wb") as f:
            start = f.tell()
            # flush per chunk: whatever arrived before a drop is kept for the next Range request
            while chunk := resp.read(_CHUNK):
                f.write(chunk)
                f.flush()
                if f.tell() > source.size:
                    break
            got = f.tell() - start
        # http.client's read(n) returns b"" on a connection closed early instead of raising, so
        # compare with Content-Length: a short body is an interruption (retry with Range), while
        # a complete body of the wrong total size is a mismatch (refused by the caller).
        if length is not None and length.isdigit() and got < int(length):
            raise http.client.IncompleteRead(b"", int(length) - got)


def download(
    source: Source,
    raw_dir: Path,
    retries: int = 5,
    backoff_s: float = 0.5,
    timeout_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Path:
    """Fetch one source into ``raw_dir/<name>``, verified; returns its path."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    final = raw_dir / source.name
    if final.is_file():
        if final.stat().st_size == source.size and sha256_file(final) == source.sha256:
            _log(f"fetch: {source.name}: present and verified")
            return final
        _log(f"fetch: {source.name}: present but does not match the config; fetching again")
        final.unlink()
    part = raw_dir / f".{source.name}.part"
    for attempt in range(retries + 1):
        try:
            _transfer(source, part, timeout_s)
            break
        except urllib.error.HTTPError as e:
            if e.code == 416 and part.exists():  # our offset is past the end: restart clean
                part.unlink()
            elif 400 <= e.code < 500 and e.code not in (408, 429):
                raise StageError(f"fetch: {source.url}: HTTP {e.code} {e.reason}") from None
            err: BaseException = e
        except (OSError, http.client.HTTPException) as e:
            err = e
        have = part.stat().st_size if part.exists() else 0
        if attempt == retries:
            raise StageError(
                f"fetch: {source.url}: failed after {retries + 1} attempts ({err!r}); "
                f"{have} of {source.size} bytes kept in {part}; rerun to resume"
            )
        _log(f"fetch: {source.name}: attempt {attempt + 1} failed ({err!r}) at byte {have}; retrying")
        sleep(backoff_s * 2**attempt)
    size = part.stat().st_size if part.exists() else 0
    if size != source.size:
        part.unlink(missing_ok=True)
        raise DigestMismatch(f"fetch: {source.url}: size mismatch: expected {source.size} bytes, got {size}; "
                             f"refused, nothing kept")
    actual = sha256_file(part)
    if actual != source.sha256:
        part.unlink()
        raise DigestMismatch(f"fetch: {source.url}: sha256 mismatch: expected {source.sha256}, "
                             f"actual {actual}; refused, nothing kept")
    os.replace(part, final)
    _log(f"fetch: {source.name}: {size} bytes, sha256 {actual}")
    return final
