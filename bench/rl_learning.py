"""Does the RL learn? The four algorithms x the two tiny looped models, from one run, on CPU.

    python bench/rl_learning.py [--out DIR] [--models nanbeige huginn_raven] [--algorithms ppo grpo ...]

Each model starts from its supervised start checkpoint on arithmetic prompts
(:func:`hobson.rl.arithmetic.ensure_start_checkpoint`, built here from nothing unless ``--out``
already holds it; the table says whether its bytes equal the shipped copy the CI test starts
from), then each algorithm trains it with the ``math`` reward on the training rows.
Held-out prompts (no (operands, operator) shared with training) are answered greedily before and
after; the test is an exact one-sided sign test (McNemar) on the prompts whose outcome changed.
The settings (seed, updates, optimizer, learning rate, batch sizes per model, the same for all
four algorithms, each algorithm's own keys at their defaults) are fixed in
``hobson.rl.arithmetic.LEARNING`` and printed first. Prints a table with each pair's p, writes
``<out>/rl_learning.json`` and ``<out>/rl_learning.png`` (held-out accuracy per version).
Goal: every pair improves with p < 0.01.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from common import write_json

from hobson.rl import arithmetic
from hobson.rl.evaluate import plot_curves

ROOT = Path(__file__).resolve().parents[1]

ALGORITHMS = ["ppo", "grpo", "dppo", "flow-dppo"]
MODELS = ["nanbeige", "huginn_raven"]


def shipped_equal(kind: str, built: Path) -> str:
    """"yes", "no (<files>)" or why there is no shipped copy to compare with: weights and config
    byte for byte (the cards differ in where they were built, the manifests with the cards)."""
    problem = arithmetic.shipped_problem(kind)
    if problem is not None:
        return f"no shipped copy ({problem})"
    shipped = arithmetic.SHIPPED / kind
    names = sorted(p.name for p in shipped.iterdir() if p.name not in (arithmetic.CARD, "manifest.json"))
    differ = [n for n in names if not (built / n).is_file() or (built / n).read_bytes() != (shipped / n).read_bytes()]
    return "no (" + ", ".join(differ) + ")" if differ else "yes"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="work directory (default: a new temp dir); start checkpoints are cached there")
    p.add_argument("--models", nargs="*", default=MODELS, choices=MODELS)
    p.add_argument("--algorithms", nargs="*", default=ALGORITHMS, choices=ALGORITHMS)
    p.add_argument("--curve-every", type=int, default=10, help="evaluate every N versions for the curves")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="rl-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; work dir {out}")
    print(f"data: a op b for a, b < {arithmetic.OPERANDS}, op in {' '.join(arithmetic.OPS)}; "
          f"{arithmetic.HELD_OUT} held-out keys")
    for kind in args.models:
        print(f"start checkpoint {kind}: {arithmetic.sft_settings(kind)}")
    for kind in args.models:
        print(f"settings {kind}: {arithmetic.LEARNING[kind]} {arithmetic.LEARNING_COMMON}")
    t_all = time.perf_counter()
    rows, curves = [], {}
    for kind in args.models:
        t0 = time.perf_counter()
        built = arithmetic.ensure_start_checkpoint(kind, out / "start")
        same = shipped_equal(kind, built)
        print(f"start checkpoint {kind}: {time.perf_counter() - t0:.1f} s; its bytes equal the shipped copy: "
              f"{same}", flush=True)
        for alg in args.algorithms:
            r = arithmetic.learning_trial(kind, alg, out, curve_every=args.curve_every, echo=lambda s: None,
                                          from_nothing=True)
            r["start_equals_shipped"] = same
            curves[f"{kind} {alg}"] = r.pop("curve")
            rows.append(r)
            print(f"{kind} {alg}: accuracy {r['before']:.3f} -> {r['after']:.3f}, +{r['improved']} "
                  f"-{r['regressed']}, p {r['p']:.2g} ({r['rl_seconds']:.0f} s of RL)", flush=True)
    total = time.perf_counter() - t_all
    print()
    print("| model | algorithm | held-out accuracy before | after | improved | regressed | one-sided p | "
          "p < 0.01 | RL s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['algorithm']} | {r['before']:.3f} | {r['after']:.3f} | {r['improved']} | "
              f"{r['regressed']} | {r['p']:.2g} | {'yes' if r['p'] < 0.01 else 'NO'} | {r['rl_seconds']:.0f} |")
    print(f"\n{sum(r['p'] < 0.01 for r in rows)} of {len(rows)} pairs improve with p < 0.01; "
          f"whole bench {total:.0f} s (start checkpoints included)")
    write_json(out / "rl_learning.json",
               {"rows": rows, "curves": {k: [asdict(v) for v in c] for k, c in curves.items()}, "seconds": total})
    plot_curves(curves, out / "rl_learning.png")
    print(f"wrote {out / 'rl_learning.json'} and {out / 'rl_learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
