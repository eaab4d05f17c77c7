"""The code a host runs: a ``git archive`` of one revision, with a manifest, uploaded to S3.

A dirty tree (tracked changes, or untracked files git does not ignore) is refused unless
``allow_dirty``; then the archive holds the working-tree version of every changed or new file
(deleted ones dropped) plus ``.hobson/dirty.diff`` (``git diff HEAD``), and the manifest says so.
The archive is a gzip with mtime 0 of a tar with fixed times, so one revision always gives the
same sha256.
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

from hobson.errors import HobsonError
from hobson.io import sha256_bytes
from hobson.records import utc_now

ARCHIVE_NAME = "code.tar.gz"
MANIFEST_NAME = "manifest.json"


@dataclass
class CodeArchive:
    revision: str
    dirty: bool
    diff_sha256: str | None
    sha256: str
    bytes: int
    files: int
    created_utc: str

    def manifest(self) -> dict:
        return {"archive": ARCHIVE_NAME, **asdict(self)}


def _git(repo: Path, *args: str, binary: bool = False) -> bytes | str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    if r.returncode != 0:
        raise HobsonError(f"git {' '.join(args)} failed in {repo}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout if binary else r.stdout.decode()


def dirty_paths(repo: Path) -> tuple[list[str], list[str]]:
    """(changed or new files, deleted files) relative to the repository root."""
    out = _git(repo, "status", "--porcelain=v1", "-z", "--untracked-files=all", binary=True)
    changed, deleted = [], []
    entries = out.split(b"\0")
    i = 0
    while i < len(entries):
        e = entries[i].decode()
        i += 1
        if not e:
            continue
        xy, path = e[:2], e[3:]
        if "R" in xy or "C" in xy:  # a rename's source follows as its own NUL-terminated field
            src = entries[i].decode()
            i += 1
            deleted.append(src)
        (deleted if "D" in xy else changed).append(path)
    return sorted(set(changed)), sorted(set(deleted))


def make_archive(repo: Path, out: Path, revision: str = "HEAD", allow_dirty: bool = False) -> CodeArchive:
    """Write ``out`` (a .tar.gz) for ``revision``; return what the manifest records."""
    repo = Path(repo)
    rev = _git(repo, "rev-parse", "--verify", f"{revision}^{{commit}}").strip()
    changed, deleted = dirty_paths(repo) if revision == "HEAD" else ([], [])
    if (changed or deleted) and not allow_dirty:
        shown = (changed + deleted)[:10]
        raise HobsonError(f"the working tree differs from {rev[:12]} ({len(changed) + len(deleted)} paths, e.g. "
                          f"{', '.join(shown)}); commit it, or pass --allow-dirty to ship the working-tree "
                          "versions and the diff")
    commit_time = int(_git(repo, "show", "-s", "--format=%ct", rev).strip())
    base = _git(repo, "archive", "--format=tar", rev, binary=True)
    dirty = bool(changed or deleted)
    diff = _git(repo, "diff", "--binary", "HEAD", binary=True) if dirty else b""
    buf = io.BytesIO()
    files = 0
    drop = set(changed) | set(deleted)
    with tarfile.open(fileobj=io.BytesIO(base)) as src, tarfile.open(fileobj=buf, mode="w",
                                                                     format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            if m.name in drop:
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
            files += m.isfile()
        for rel in changed:
            p = repo / rel
            if not p.is_file():
                continue
            info = tarfile.TarInfo(rel)
            data = p.read_bytes()
            info.size, info.mtime, info.mode = len(data), commit_time, p.stat().st_mode & 0o777
            dst.addfile(info, io.BytesIO(data))
            files += 1
        if dirty:
            info = tarfile.TarInfo(".hobson/dirty.diff")
            info.size, info.mtime, info.mode = len(diff), commit_time, 0o644
            dst.addfile(info, io.BytesIO(diff))
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0) as f:
        f.write(buf.getvalue())
    data = gz.getvalue()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return CodeArchive(revision=rev, dirty=dirty, diff_sha256=sha256_bytes(diff) if dirty else None,
                       sha256=sha256_bytes(data), bytes=len(data), files=files, created_utc=utc_now())


def code_keys(run_id: str) -> tuple[str, str]:
    return f"code/{run_id}/{ARCHIVE_NAME}", f"code/{run_id}/{MANIFEST_NAME}"


def upload(s3, bucket: str, run_id: str, archive_path: Path, archive: CodeArchive) -> tuple[str, str]:
    """Upload the archive, then its manifest (the manifest's presence means the archive is complete)."""
    akey, mkey = code_keys(run_id)
    s3.put_object(Bucket=bucket, Key=akey, Body=archive_path.read_bytes(), ContentType="application/gzip",
                  Metadata={"sha256": archive.sha256, "revision": archive.revision})
    s3.put_object(Bucket=bucket, Key=mkey, Body=json.dumps(archive.manifest(), indent=1, sort_keys=True).encode(),
                  ContentType="application/json")
    return akey, mkey
