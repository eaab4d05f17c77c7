"""Arithmetic prompts of the shipped kind and supervised start checkpoints for the tiny looped models.

RL from a random tiny model learns nothing under the ``math`` reward (it never answers), so the
learning bench (``bench/rl_learning.py``) and its CI test start each tiny model (Huginn-shaped,
Nanbeige-shaped) from a checkpoint trained supervised on arithmetic prompts, built in code and
cached like the embedded teacher (:mod:`hobson.tinymodel`):

- :func:`split`: every ``What is a op b? Answer with \\boxed{}.`` for ``a, b < OPERANDS`` and
  ``op`` in ``+ -``, split by a fixed shuffle into training and held-out rows that share no
  (operands, operator);
- :func:`ensure_start_checkpoint`: ``SFT_STEPS`` AdamW steps of teacher forcing on the training
  rows' answers (``\\boxed{<value>}`` then end of text), exported as a model directory that
  ``python -m jobs.rl --model DIR`` loads. The model learns the answer format fully and the
  arithmetic only partly, which leaves RL room to raise the reward.

Deterministic: the same torch version on the same CPU builds the same bytes. A cached directory
carries a card with the recipe; one built by another recipe is rebuilt, never reused.

Shipped: ``src/hobson/rl/start/<kind>/`` holds each start checkpoint as this recipe built it from
nothing (``python -m hobson.rl.arithmetic --ship``; its card names the torch version and CPU, its
manifest every file's SHA-256). :func:`start_checkpoint` uses it when its recipe is the current
one and its bytes verify, so the CI test spends its time on RL rather than on the ~1,000
supervised steps (whose last bits, amplified, also differ from CPU to CPU); the learning bench
builds from nothing and reports whether its bytes equal the shipped ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from hobson import manifest
from hobson.io import atomic_dir, write_json_atomic, write_text_atomic
from hobson.models import get_provider, tiny_config
from hobson.models.huginn import latent_like
from hobson.rl.config import RLConfig
from hobson.rl.data import ByteTokenizer
from hobson.rollout.engine import is_recurrent_depth
from hobson.threads import threads

OPERANDS = 20
OPS = ("+", "-")
HELD_OUT = 200  # (a, op, b) keys left out of training
SPLIT_SEED = 0
SFT = {"steps": 400, "batch": 32, "lr": 3e-3, "seed": 1, "latent_noise": "fresh", "block_size": 128}
# per model, over SFT. Chosen on this 2-core CPU: after 400 steps the Nanbeige-shaped model
# answered 11% of held-out prompts and RL's gains there were within the churn of greedy answers
# (+7 -6); more supervised steps leave a model whose RL gains stand out (see LEARNING)
SFT_KIND: dict[str, dict[str, Any]] = {"nanbeige": {"steps": 1200}, "huginn_raven": {"steps": 800}}
RECIPE_VERSION = 3
CARD = "hobson_start.json"
SHIPPED = Path(__file__).with_name("start")  # SHIPPED / kind: the start checkpoints built by --ship
# where a build happened; recorded on the card, not part of the recipe a cached copy must match
BUILT_ON = ("torch", "cpu")
# intra-op reductions split by thread count, and 400 steps amplify the last bits: the start
# checkpoint and the learning trials always run on this many threads, whatever the caller set
THREADS = 2


def prompt(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? Answer with \\boxed{{}}."


def answer(a: int, op: str, b: int) -> str:
    return str(a + b if op == "+" else a - b)


def split() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train, held_out)`` rows ``{"prompt", "label"}``; no (a, op, b) is in both."""
    keys = [(a, op, b) for a in range(OPERANDS) for op in OPS for b in range(OPERANDS)]
    random.Random(SPLIT_SEED).shuffle(keys)
    rows = [{"prompt": prompt(*k), "label": answer(*k)} for k in keys]
    return rows[HELD_OUT:], rows[:HELD_OUT]


def write_split(out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``train.jsonl`` and ``held_out.jsonl`` in ``out_dir``."""
    out = Path(out_dir)
    paths = []
    for name, rows in zip(("train.jsonl", "held_out.jsonl"), split(), strict=True):
        write_text_atomic(out / name, "".join(json.dumps(r) + "\n" for r in rows))
        paths.append(out / name)
    return paths[0], paths[1]


def sft_settings(kind: str) -> dict[str, Any]:
    """The supervised recipe of ``kind``'s start checkpoint."""
    return {**SFT, **SFT_KIND[kind]}


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def _card(kind: str) -> dict[str, Any]:
    return {"kind": f"hobson-rl-start:{kind}", "recipe_version": RECIPE_VERSION, "operands": OPERANDS,
            "ops": list(OPS), "held_out": HELD_OUT, "split_seed": SPLIT_SEED, "sft": sft_settings(kind),
            "torch": torch.__version__, "threads": THREADS, "cpu": _cpu_name()}


def _recipe(card: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in card.items() if k not in BUILT_ON}


def _batch(rows: list[dict[str, str]], tok: ByteTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, spans = [], []
    for r in rows:
        p = tok.encode(r["prompt"])
        c = tok.encode(f"\\boxed{{{r['label']}}}") + [tok.eos_id]
        seqs.append(p + c)
        spans.append((len(p) - 1, len(p) - 1 + len(c)))  # logits at t score token t + 1
    L = max(map(len, seqs))
    ids = torch.full((len(rows), L), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L - 1)
    for i, (s, (a, b)) in enumerate(zip(seqs, spans, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, a:b] = 1
    return ids, mask


def train_start_model(kind: str, echo: Any = print, *, steps: int | None = None) -> tuple[Any, torch.nn.Module]:
    """``(provider, model)``: the tiny ``kind`` model after the supervised steps of :func:`sft_settings`
    (``steps`` fewer of them: a test of this code path, not a start checkpoint)."""
    sft = {**sft_settings(kind), **({"steps": steps} if steps is not None else {})}
    tok = ByteTokenizer()
    train, _ = split()
    mcfg = tiny_config(kind, **({"block_size": sft["block_size"]} if kind == "huginn_raven" else {}))
    provider = get_provider(mcfg)
    model = provider.build_actor(mcfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=sft["lr"], weight_decay=0.0)
    g = random.Random(sft["seed"])
    recurrent = is_recurrent_depth(model)
    # Huginn's initial states: fresh every step, from the latent profile's distribution but one
    # seeded generator (the reference derivation costs a CPU generator per position). A fixed pool
    # of states taught the model that pool: under the fresh noise of rollouts and evaluation its
    # answers then flipped with the noise, and RL's gains did not carry to held-out prompts.
    noise = torch.Generator().manual_seed(sft["seed"])
    model.train()
    for step in range(1, sft["steps"] + 1):
        ids, mask = _batch([train[g.randrange(len(train))] for _ in range(sft["batch"])], tok)
        kw: dict[str, Any] = {}
        if recurrent:
            kw = {"latent_state": latent_like(ids.shape[0], ids.shape[1], mcfg.n_embd, noise),
                  "num_steps_no_grad": 0, "num_steps_with_grad": mcfg.mean_recurrence}
        logits = model(ids, **kw)[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == sft["steps"]:
            echo(f"rl start checkpoint {kind}: step {step}/{sft['steps']} loss {loss.item():.4f}")
    model.eval()
    return provider, model


def ensure_start_checkpoint(kind: str, cache_dir: str | os.PathLike, echo: Any = print) -> Path:
    """Build (once) and return ``cache_dir/<kind>``: the supervised start checkpoint of ``kind``.

    Built into a temporary sibling and renamed into place (a concurrent builder's copy is
    discarded); a directory with another recipe's card is replaced.
    """
    target = Path(cache_dir) / kind
    card = _card(kind)
    with contextlib.suppress(OSError, ValueError):
        if _recipe(json.loads((target / CARD).read_text(encoding="utf-8"))) == _recipe(card):
            return target
    with atomic_dir(target, exists="replace", mode=0o755) as tmp:
        with threads(THREADS):
            provider, model = train_start_model(kind, echo)
        provider.export(model, tmp)
        write_json_atomic(tmp / CARD, card)
        manifest.write(tmp, kind=card["kind"])  # last: a directory with its manifest is whole
    return target


def shipped_problem(kind: str, root: Path = SHIPPED) -> str | None:
    """Why the shipped start checkpoint of ``kind`` (``root / kind``) cannot be used (None: it
    can): missing, built by another recipe than this module's, or bytes that differ from its manifest."""
    target = root / kind
    try:
        card = json.loads((target / CARD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{target / CARD}: {e}"
    if _recipe(card) != _recipe(_card(kind)):
        now = _card(kind)
        diff = sorted(k for k in {**card, **now} if k not in BUILT_ON and card.get(k) != now.get(k))
        return (f"{target}: built by another recipe (differs in {', '.join(diff)}); "
                "rebuild it: python -m hobson.rl.arithmetic --ship")
    try:
        found = manifest.read(target)
        if found is None:
            return f"{target}: no {manifest.MANIFEST}"
        manifest.verify(target, found)
    except manifest.ManifestMismatch as e:
        return str(e)
    return None


def start_checkpoint(kind: str, cache_dir: str | os.PathLike, echo: Any = print, *,
                     from_nothing: bool = False) -> Path:
    """The start checkpoint of ``kind``: the shipped one when it is of this recipe and verifies,
    else (or with ``from_nothing``) :func:`ensure_start_checkpoint` under ``cache_dir``."""
    if not from_nothing:
        problem = shipped_problem(kind)
        if problem is None:
            return SHIPPED / kind
        echo(f"rl start checkpoint {kind}: not using the shipped one ({problem}); building it")
    return ensure_start_checkpoint(kind, cache_dir, echo)


# ---------------------------------------------------------------------------------------------
# One learning trial: a start checkpoint, an RL run on the training rows, held-out before/after

# Per model, the same for all four algorithms (each algorithm's own keys at their defaults, so
# GRPO samples 4 completions per prompt and the others 1). The last bits of a CPU's kernels
# decide which greedy answers flip, so another CPU gives other counts: 50 updates rather than
# the 30 first chosen (on an AMD EPYC), because on an Intel Xeon PPO and DPPO had p 0.017 at 30
# on Huginn and 0.0016 on Nanbeige, and 3e-5 / 4.5e-7 at 50 (the rate is constant, so the
# curve of one longer run showed it). Huginn at lr 3e-4 lost more held-out answers than it gained.
LEARNING = {
    "nanbeige": {"updates": 50, "prompts_per_update": 32, "optimizer": "AdamW", "lr": 3e-4},
    "huginn_raven": {"updates": 50, "prompts_per_update": 32, "optimizer": "AdamW", "lr": 1e-4},
}
LEARNING_COMMON = {"seed": 42, "max_new_tokens": 12, "temperature": 0.8, "reward": "math", "device": "cpu",
                   "trainer": "torch"}


def learning_config(kind: str, algorithm: str, start: Path, train: Path, out: Path,
                    overrides: dict[str, Any] | None = None) -> RLConfig:
    """The settings of one trial (``python -m jobs.rl`` with these as flags runs the same)."""
    settings = {**LEARNING_COMMON, **LEARNING[kind], **(overrides or {})}
    return RLConfig(algorithm=algorithm, model=str(start), data=str(train), output=str(out), **settings)


def learning_trial(kind: str, algorithm: str, root: str | os.PathLike, *, curve_every: int = 10,
                   overrides: dict[str, Any] | None = None, echo: Any = print,
                   from_nothing: bool = False) -> dict[str, Any]:
    """Run one (model, algorithm) pair from its start checkpoint; returns before/after held-out
    accuracy, the sign test on the prompts whose greedy outcome changed, and the curve."""
    import time

    from hobson.rl.evaluate import evaluate, sign_test
    from hobson.rl.loop import run

    root = Path(root)
    start = start_checkpoint(kind, root / "start", echo, from_nothing=from_nothing)
    train, held = write_split(root / "data")
    out = root / f"{kind}-{algorithm}"
    if out.exists():
        shutil.rmtree(out)
    updates = int({**LEARNING[kind], **(overrides or {})}["updates"])
    t0 = time.perf_counter()
    with threads(THREADS):
        run(learning_config(kind, algorithm, start, train, out, overrides), ["hobson.rl.arithmetic", kind, algorithm])
        rl_s = time.perf_counter() - t0
        versions = sorted({0, updates, *range(0, updates, curve_every)})
        res = evaluate(out, held, versions=versions, echo=echo)
    up, down, p = sign_test(res[0].correct, res[-1].correct)
    return {"model": kind, "algorithm": algorithm, "before": res[0].accuracy, "after": res[-1].accuracy,
            "reward_before": res[0].reward_mean, "reward_after": res[-1].reward_mean, "boxed_before": res[0].boxed,
            "improved": up, "regressed": down, "p": p, "rl_seconds": rl_s, "curve": res, "run": str(out)}


def main(argv: list[str] | None = None) -> int:
    """``python -m hobson.rl.arithmetic --ship``: build every start checkpoint from nothing into
    :data:`SHIPPED` (commit the result; the learning test then starts from it)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--ship", action="store_true", help=f"(re)build the start checkpoints under {SHIPPED}")
    p.add_argument("--kinds", nargs="*", default=list(SFT_KIND), choices=list(SFT_KIND))
    args = p.parse_args(argv)
    if not args.ship:
        for kind in SFT_KIND:
            print(f"{kind}: {shipped_problem(kind) or 'shipped, verified'}")
        return 0
    for kind in args.kinds:
        out = SHIPPED / kind
        if out.exists():
            shutil.rmtree(out)
        print(ensure_start_checkpoint(kind, SHIPPED))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
