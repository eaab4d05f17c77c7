"""Held-out evaluation of RL policies: greedy reward and accuracy per publication version.

``evaluate(run_or_publication, data)`` loads each publication (verified by its digest, as the
rollout engine loads it) into an in-process native engine, answers every prompt of ``data``
greedily (temperature 0: the policy's own best answer, no sampling noise), scores it with the
run's reward and reports, per version: mean reward, accuracy (share of prompts with reward 1),
the share of answers with a ``\\boxed{}``, and each prompt's outcome (what a paired test between
two versions needs, :func:`sign_test`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hobson.errors import DataError
from hobson.models import get_provider
from hobson.rl import data as rldata
from hobson.rl.config import TINY_PREFIX
from hobson.rl.reward import get_reward, last_boxed
from hobson.rollout import publication


@dataclass
class VersionResult:
    version: int
    reward_mean: float
    accuracy: float
    boxed: float
    n: int
    correct: list[int] = field(repr=False)  # per prompt, 1 if its reward is 1.0


def _publications(path: Path) -> list[Path]:
    """The publications to evaluate: ``path`` itself, or every version of a run with its weights."""
    if (path / publication.MANIFEST).is_file():
        return [path]
    root = path / "publications"
    if not root.is_dir():
        raise DataError(f"{path}: neither a publication (no {publication.MANIFEST}) nor an RL run (no publications/)")
    found = sorted(d for d in root.iterdir() if d.name.startswith("v") and (d / publication.MANIFEST).is_file())
    # a pruned version keeps its manifest only (--keep-publications): nothing to load
    kept = [d for d in found if (d / "config.json").is_file()]
    if not kept:
        raise DataError(f"{root}: no publication with its weights (all pruned?)")
    return kept


def _settings(path: Path) -> dict[str, Any]:
    for run in (path, path.parent.parent):
        f = run / "run.json"
        if f.is_file():
            return json.loads(f.read_text(encoding="utf-8"))["rl"]["settings"]
    return {}


def evaluate(
    path: str | os.PathLike,
    data: str | os.PathLike,
    *,
    versions: list[int] | None = None,
    reward: str | None = None,
    max_new_tokens: int | None = None,
    max_prompt_tokens: int | None = None,
    batch_size: int = 64,
    device: str = "cpu",
    echo: Any = print,
) -> list[VersionResult]:
    """Greedy held-out results of every publication of a run (or of one publication); settings the
    caller leaves out come from the run's run.json (reward, token limits), else hobson's defaults."""
    path = Path(path)
    pubs = _publications(path)
    if versions is not None:
        pubs = [p for p in pubs if publication.Manifest.read(p).version in set(versions)]
        if not pubs:
            raise DataError(f"{path}: none of versions {versions} has a publication with its weights")
    settings = _settings(path)
    reward_fn = get_reward(reward or settings.get("reward", "math"))
    max_new = max_new_tokens or settings.get("max_new_tokens", 48)
    max_prompt = max_prompt_tokens or settings.get("max_prompt_tokens", 128)
    rows = rldata.load_prompts(data)
    provider = get_provider(pubs[0])
    mcfg = provider.config(pubs[0])
    spec = settings.get("model") or ""
    tok = rldata.tokenizer_for(None if not spec or spec.startswith(TINY_PREFIX) else spec, mcfg.vocab_size)
    prompts = [rldata.encode_prompt(tok, r.prompt, max_prompt) for r in rows]
    from hobson.rollout.engine import NativeEngine

    results = []
    for pub in pubs:
        man = json.loads((pub / publication.MANIFEST).read_text(encoding="utf-8"))
        engine = NativeEngine(
            provider,
            dtype=getattr(torch, man["dtype"]),
            device=device,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            model_revision=man["model_revision"],
            engine_revision=man["engine_revision"],
        )
        try:
            engine.load_publication(pub)
            rewards, boxed = [], []
            for i in range(0, len(prompts), batch_size):
                chunk = prompts[i : i + batch_size]
                # greedy: the seed picks only Huginn's latents, one fixed per prompt index
                outs = engine.generate(chunk, list(range(i, i + len(chunk))), 0.0, max_new)
                for o, row in zip(outs, rows[i : i + len(chunk)], strict=True):
                    text = tok.decode([t for t in o.tokens if t != tok.eos_id])
                    rewards.append(float(reward_fn(text, o.tokens, row.label)))
                    boxed.append(last_boxed(text) is not None)
        finally:
            engine.close()
        res = VersionResult(
            version=int(man["version"]),
            reward_mean=sum(rewards) / len(rewards),
            accuracy=sum(r == 1.0 for r in rewards) / len(rewards),
            boxed=sum(boxed) / len(boxed),
            n=len(rewards),
            correct=[int(r == 1.0) for r in rewards],
        )
        echo(f"rl_eval: version {res.version}: reward {res.reward_mean:.4f}, accuracy {res.accuracy:.4f}, "
             f"boxed {res.boxed:.4f} on {res.n} prompts")
        results.append(res)
    return results


def sign_test(before: list[int], after: list[int]) -> tuple[int, int, float]:
    """Exact one-sided sign test (McNemar) on the prompts whose outcome changed between two
    versions: ``(improved, regressed, p)`` with p = P(X >= improved), X ~ Binomial(changed, 1/2)."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} vs {len(after)} outcomes: not the same prompts")
    up = sum(1 for a, b in zip(before, after, strict=True) if b > a)
    down = sum(1 for a, b in zip(before, after, strict=True) if b < a)
    n = up + down
    p = sum(math.comb(n, k) for k in range(up, n + 1)) / 2**n if n else 1.0
    return up, down, p


def write_report(results: list[VersionResult], out: str | os.PathLike, title: str = "") -> tuple[Path, Path]:
    """``<out>/rl_eval.json`` and ``<out>/rl_eval.png`` (reward and accuracy per version)."""
    from hobson.io import write_json_atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "rl_eval.json"
    write_json_atomic(js, {"title": title, "versions": [asdict(r) for r in results]})
    png = out / "rl_eval.png"
    plot_curves({title or "policy": results}, png)
    return js, png


def plot_curves(curves: dict[str, list[VersionResult]], png: str | os.PathLike) -> None:
    """One line per curve: held-out accuracy against publication version (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hobson.io import atomic_write

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, res in curves.items():
        ax.plot([r.version for r in res], [r.accuracy for r in res], marker="o", ms=3, label=name)
    ax.set_xlabel("publication version (updates)")
    ax.set_ylabel("held-out accuracy (greedy)")
    top = max((r.accuracy for res in curves.values() for r in res), default=1.0)
    ax.set_ylim(0, min(1.0, top * 1.25 + 0.02))  # small tiny-model gains stay visible
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_write(png, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
