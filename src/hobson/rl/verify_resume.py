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
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    items.append(
        Item(
            "publication versions",
            None if list(manifests[0]) == list(manifests[1]) else f"{sorted(manifests[0])} vs {sorted(manifests[1])}",
        )
    )
    for v in sorted(set(manifests[0]) & set(manifests[1])):
        items.append(
            Item(
                f"publication {v} digest",
                None if manifests[0][v] == manifests[1][v] else f"{manifests[0][v]} vs {manifests[1][v]}",
            )
        )
    return items
