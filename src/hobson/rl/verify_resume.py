"""Compare two RL runs bit for bit: an uninterrupted one and a stopped-then-resumed one.

``compare_runs(a, b)`` returns one :class:`Item` per compared thing, in this order:

- per checkpoint present in either run (``checkpoints/update-k``): actor parameters, critic
  parameters, optimizer state, scheduler state, loss scaler, RNG state (python, numpy, torch
  CPU/CUDA), data cursor, publication version and digest;
- per update's rollouts (``rollouts/update-k.jsonl``): tokens (prompt and completion, seeds),
  behaviour log-probs, rewards, latent traces, (version, digest) of every sample;
- publications: the versions published and each one's digest (run.json's publish events and the
  manifests on disk).

Each item is equal or carries the first difference. Timings (metrics.jsonl, run.json) are not
compared: they differ between any two runs.

A run can also be compared against a *record* of another: :func:`record_run` reduces a run to the
sha256 digests of every item above (JSON, a few hundred kB), so the first run's large files can
be deleted before the second run starts (two official-size Huginn runs do not fit one 64 GiB
disk). :func:`compare_records` compares two records and gives each item the same verdict (equal
or different) as :func:`compare_runs` gives the two runs; :func:`compare` takes runs or records.
A record names a difference down to the tensor, dict key or list element it digests (every tensor,
and every node up to two levels below an item); it cannot say which element of a tensor differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hobson import bytepool
from hobson.errors import StageError
from hobson.io import read_jsonl
from hobson.rl import checkpoint as ckpt
from hobson.rollout.publication import MANIFEST


@dataclass(frozen=True)
class Item:
    name: str
    difference: str | None  # None: equal

    def line(self) -> str:
        return f"{self.name}: equal" if self.difference is None else f"{self.name}: DIFFERENT: {self.difference}"


def _trainer_part(state: dict[str, Any], key: str) -> dict[str, Any]:
    return {role: state[role][key] for role in ("actor_trainer", "critic_trainer") if role in state}


CHECKPOINT_PARTS: list[tuple[str, Any]] = [
    ("actor parameters", lambda s: s["actor"]),
    ("critic parameters", lambda s: s["critic"]),
    ("optimizer state", lambda s: _trainer_part(s, "optimizer")),
    ("scheduler state", lambda s: _trainer_part(s, "scheduler")),
    ("loss scaler", lambda s: _trainer_part(s, "loss_scale")),
    ("RNG state", lambda s: s["rng"]),
    ("data cursor", lambda s: s["data_cursor"]),
    ("publication version and digest", lambda s: (s["version"], s["digest"])),
]

ROLLOUT_PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("tokens", ("prompt_index", "completion_index", "seed", "prompt_tokens", "tokens")),
    ("behaviour log-probs", ("logprobs",)),
    ("rewards", ("reward",)),
    ("latent traces", ("trace",)),
    ("sample (version, digest)", ("version", "digest")),
]


def _updates(run: Path, sub: str, pattern: str) -> set[int]:
    d = run / sub
    if not d.is_dir():
        return set()
    return {int(p.stem.split("-")[1]) for p in d.glob(pattern) if p.stem.split("-")[1].isdigit()}


def _version_digests(run: Path) -> dict[str, str]:
    """Each published version's digest: from the run's publish events (every transport records
    them; ``--transport dist`` writes no publication files), else from a manifest on disk. A
    manifest on disk that disagrees with the record shows as ``record/manifest``."""
    found: dict[str, str] = {}
    try:
        meta = json.loads((run / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    for session in meta.get("rl", {}).get("sessions", []):
        for e in session.get("events", []):
            if e.get("event") == "publish":
                found[f"v{int(e['version']):06d}"] = e["digest"]
    for p in sorted((run / "publications").glob("v[0-9]*")):
        if (p / MANIFEST).exists():
            digest = json.loads((p / MANIFEST).read_text(encoding="utf-8"))["digest"]
            if found.setdefault(p.name, digest) != digest:
                found[p.name] = f"{found[p.name]}/{digest}"
    return dict(sorted(found.items()))


def compare_runs(a: str | os.PathLike, b: str | os.PathLike) -> list[Item]:
    a, b = Path(a), Path(b)
    items: list[Item] = []
    ups = sorted(set(ckpt.list_checkpoints(a)) | set(ckpt.list_checkpoints(b)))
    if not ups:
        items.append(Item("checkpoints", "neither run has a checkpoint"))
    for k in ups:
        tag = f"checkpoint update-{k:06d}"
        paths = [ckpt.checkpoint_dir(r, k) for r in (a, b)]
        missing = [str(p) for p in paths if not (p / "state.pt").exists()]
        if missing:
            items.append(Item(tag, f"missing in {', '.join(missing)}"))
            continue
        sa, sb = (ckpt.load_checkpoint(p) for p in paths)
        for name, get in CHECKPOINT_PARTS:
            items.append(Item(f"{tag} {name}", ckpt.first_difference(get(sa), get(sb), name.split()[0])))
    rollout_ups = sorted(_updates(a, "rollouts", "update-*.jsonl") | _updates(b, "rollouts", "update-*.jsonl"))
    for k in rollout_ups:
        tag = f"rollouts update-{k:06d}"
        files = [r / "rollouts" / f"update-{k:06d}.jsonl" for r in (a, b)]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            items.append(Item(tag, f"missing in {', '.join(missing)}"))
            continue
        ra, rb = (read_jsonl(f) for f in files)
        for name, keys in ROLLOUT_PARTS:
            pa = [{key: row.get(key) for key in keys} for row in ra]
            pb = [{key: row.get(key) for key in keys} for row in rb]
            items.append(Item(f"{tag} {name}", ckpt.first_difference(pa, pb, "row")))
    manifests = [_version_digests(r) for r in (a, b)]
    return items + publication_items(*manifests)


# ------------------------------------------------------------------------------------ records
RECORD_FORMAT = "hobson-verify-resume-record/1"
_DEPTH = 2  # nodes recorded below an item's root (every tensor, and the containers above it, always)
_CHUNK = 64 << 20  # tensors larger than this are hashed as 64 MiB chunks in threads


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _bytes_digest(data: np.ndarray) -> str:
    """sha256 of the bytes; over 64 MiB, sha256 of the chunks' sha256s (hashlib frees the GIL)."""
    view = memoryview(data)
    if data.nbytes <= _CHUNK:
        return _sha(view)
    chunks = [view[i : i + _CHUNK] for i in range(0, data.nbytes, _CHUNK)]
    return _sha(b"chunks", *(bytes.fromhex(d) for d in bytepool.pool().map(_sha, chunks)))


def _tensor_type(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)}"


def _value(x: Any) -> str:
    """A scalar as first_difference compares it: its type and value (-0.0 == 0.0, NaN == NaN)."""
    if isinstance(x, float):
        v = "nan" if x != x else ("0.0" if x == 0 else repr(x))
    else:
        v = repr(x)
    return f"{type(x).__name__}:{v}"


def _digest(obj: Any, path: str, depth: int, out: dict[str, dict[str, Any]]) -> tuple[str, bool]:
    """The digest of ``obj`` (equal exactly when :func:`checkpoint.first_difference` finds no
    difference: lists and tuples alike, tensors by dtype, shape and bytes); records its node and
    the nodes below it that :data:`_DEPTH` keeps into ``out``. Returns (digest, holds a tensor)."""
    if isinstance(obj, np.ndarray):
        obj = torch.from_numpy(np.asarray(obj).copy())
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)
        kind = _tensor_type(obj)
        d = _sha(b"tensor:", kind.encode(), b":", _bytes_digest(data).encode())
        out[path] = {"sha256": d, "tensor": kind}
        return d, True
    if isinstance(obj, dict) or isinstance(obj, (list, tuple)):
        is_dict = isinstance(obj, dict)
        keys = sorted(obj, key=str) if is_dict else list(range(len(obj)))
        h = hashlib.sha256(b"dict:" if is_dict else f"list:{len(obj)}:".encode())
        has_tensor = False
        below: dict[str, dict[str, Any]] = {}
        for k in keys:
            cpath = (f"{path}.{k}" if path else str(k)) if is_dict else f"{path}[{k}]"
            sub: dict[str, dict[str, Any]] = {}
            d, t = _digest(obj[k], cpath, depth + 1, sub)
            if is_dict:
                h.update(_value(k).encode() + b"=")
            h.update(d.encode() + b";")
            if t or depth + 1 <= _DEPTH:
                below.update(sub)
            has_tensor |= t
        d = h.hexdigest()
        out[path] = {"sha256": d, "keys": [str(k) for k in keys]} if is_dict else {"sha256": d, "len": len(obj)}
        out.update(below)
        return d, has_tensor
    v = _value(obj)
    d = _sha(b"value:", v.encode())
    out[path] = {"sha256": d, **({"value": repr(obj)} if len(v) <= 200 else {})}
    return d, False


def digest_tree(obj: Any, path: str) -> dict[str, Any]:
    """``{"path": path, "nodes": {path: node}}``: the item's root digest and the recorded nodes."""
    nodes: dict[str, dict[str, Any]] = {}
    _digest(obj, path, 0, nodes)
    return {"path": path, "nodes": nodes}


def _describe(node: dict[str, Any]) -> str:
    if "tensor" in node:
        return node["tensor"]
    if "keys" in node:
        return "dict"
    if "len" in node:
        return "list"
    return node.get("value", "value")


def tree_difference(ta: dict[str, Any], tb: dict[str, Any]) -> str | None:
    """None if two digest trees are equal, else the first place (in first_difference's order) they differ."""
    na_all, nb_all = ta["nodes"], tb["nodes"]

    def walk(path: str) -> str:
        na, nb = na_all[path], nb_all[path]
        short = f"sha256 {na['sha256'][:16]} vs {nb['sha256'][:16]}"
        kinds = [("tensor" in n, "keys" in n, "len" in n) for n in (na, nb)]
        if kinds[0] != kinds[1]:
            return f"{path}: {_describe(na)} vs {_describe(nb)}"
        if "tensor" in na:
            if na["tensor"] != nb["tensor"]:
                return f"{path}: {na['tensor']} vs {nb['tensor']}"
            return f"{path}: {na['tensor']} bytes differ ({short})"
        if "keys" in na:
            if set(na["keys"]) != set(nb["keys"]):
                return f"{path}: keys {sorted(set(na['keys']) ^ set(nb['keys']))[:5]} in only one"
            children = [f"{path}.{k}" if path else k for k in na["keys"]]
        elif "len" in na:
            if na["len"] != nb["len"]:
                return f"{path}: length {na['len']} vs {nb['len']}"
            children = [f"{path}[{i}]" for i in range(na["len"])]
        else:
            if "value" in na and "value" in nb:
                return f"{path}: {na['value']} vs {nb['value']}"
            return f"{path}: {short}"
        for c in children:
            if c not in na_all or c not in nb_all:
                return f"{path}: {short} (not recorded further down)"
            if na_all[c]["sha256"] != nb_all[c]["sha256"]:
                return walk(c)
        return f"{path}: {short}"

    if na_all[ta["path"]]["sha256"] == nb_all[tb["path"]]["sha256"]:
        return None
    return walk(ta["path"])


def record_run(run: str | os.PathLike) -> dict[str, Any]:
    """The digests of everything :func:`compare_runs` compares in ``run`` (see the module doc)."""
    run = Path(run)
    rec: dict[str, Any] = {"format": RECORD_FORMAT, "run": str(run), "checkpoints": {}, "rollouts": {}}
    for k in ckpt.list_checkpoints(run):
        state = ckpt.load_checkpoint(ckpt.checkpoint_dir(run, k))
        rec["checkpoints"][str(k)] = {name: digest_tree(get(state), name.split()[0]) for name, get in CHECKPOINT_PARTS}
        del state
    for k in sorted(_updates(run, "rollouts", "update-*.jsonl")):
        rows = read_jsonl(run / "rollouts" / f"update-{k:06d}.jsonl")
        rec["rollouts"][str(k)] = {
            name: digest_tree([{key: row.get(key) for key in keys} for row in rows], "row")
            for name, keys in ROLLOUT_PARTS
        }
    rec["publications"] = _version_digests(run)
    return rec


def load_record(path: str | os.PathLike) -> dict[str, Any]:
    try:
        rec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: not a verify-resume record ({type(e).__name__}: {e})") from None
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
        raise StageError(f"{path}: not a verify-resume record (format {RECORD_FORMAT} expected)")
    return rec


def compare_records(ra: dict[str, Any], rb: dict[str, Any]) -> list[Item]:
    """The items of :func:`compare_runs`, from two records: the same names and verdicts."""
    items: list[Item] = []
    runs = (Path(ra["run"]), Path(rb["run"]))
    ups = sorted({int(k) for k in ra["checkpoints"]} | {int(k) for k in rb["checkpoints"]})
    if not ups:
        items.append(Item("checkpoints", "neither run has a checkpoint"))
    for k in ups:
        tag = f"checkpoint update-{k:06d}"
        parts = [r["checkpoints"].get(str(k)) for r in (ra, rb)]
        missing = [str(ckpt.checkpoint_dir(run, k)) for run, p in zip(runs, parts, strict=True) if p is None]
        if missing:
            items.append(Item(tag, f"missing in {', '.join(missing)}"))
            continue
        for name, _ in CHECKPOINT_PARTS:
            items.append(Item(f"{tag} {name}", tree_difference(parts[0][name], parts[1][name])))
    for k in sorted({int(k) for k in ra["rollouts"]} | {int(k) for k in rb["rollouts"]}):
        tag = f"rollouts update-{k:06d}"
        parts = [r["rollouts"].get(str(k)) for r in (ra, rb)]
        missing = [
            str(run / "rollouts" / f"update-{k:06d}.jsonl") for run, p in zip(runs, parts, strict=True) if p is None
        ]
        if missing:
            items.append(Item(tag, f"missing in {', '.join(missing)}"))
            continue
        for name, _ in ROLLOUT_PARTS:
            items.append(Item(f"{tag} {name}", tree_difference(parts[0][name], parts[1][name])))
    manifests = [r["publications"] for r in (ra, rb)]
    return items + publication_items(*manifests)


def publication_items(a: dict[Any, Any], b: dict[Any, Any]) -> list[Item]:
    """The version lists of two runs (or records), then each common version's digest."""
    items = [Item("publication versions", None if list(a) == list(b) else f"{sorted(a)} vs {sorted(b)}")]
    for v in sorted(set(a) & set(b)):
        items.append(Item(f"publication {v} digest", None if a[v] == b[v] else f"{a[v]} vs {b[v]}"))
    return items


def compare(a: str | os.PathLike, b: str | os.PathLike) -> list[Item]:
    """Two run directories (:func:`compare_runs`), or a record file and a run or record."""
    a, b = Path(a), Path(b)
    if a.is_dir() and b.is_dir():
        return compare_runs(a, b)
    for p in (a, b):
        if not p.exists():
            raise StageError(f"{p}: neither a run directory nor a record file")
    return compare_records(*(record_run(p) if p.is_dir() else load_record(p) for p in (a, b)))
