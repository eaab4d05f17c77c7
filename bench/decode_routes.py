"""Decode with the 16-bit GEMM routes against cuBLAS's default, one card.

    python bench/decode_routes.py --json bench/results/decode_routes-<date>.json [--models nanbeige,huginn_raven]
        [--routes TABLE.json --variants cublas,routes --repeat 3]

A route per 16-bit decode GEMM shape and card (src/hobson/models/skinny.py ``ROUTES_16BIT``,
filled from this bench's figures: an H200's Nanbeige table since session 31, 1.05x a step; none for
an H100, where no reliable whole-step gain showed;
``HOBSON_GEMM16_ROUTES`` names a table to try, ``none`` for cuBLAS throughout): cuBLASLt, the
swapped-operand product ``(W @ xᵀ)ᵀ``, or a Triton tile. (SwiGLU inside the down projection's
loads, a third variant until session 30, was slower on both models on an H100 and was removed.)

Steps, each in its own process: ``bench/skinny_gemm.py --sweep`` times every kernel choice per shape
(bf16, the models asked for); the fastest choice per shape that is at least ``--margin`` faster
than cuBLAS and (Triton) repeats its bits goes into a route table; then ``bench/rl_gpu.py --parts
rollout --rollout-dtype bfloat16 --engines now`` runs per model with cuBLAS throughout (the
baseline) and with the table (``--variants``), ``--repeat`` times
interleaved. The table prints each variant's fastest decode ms/step and every run's, the ratio to
cuBLAS in the same run, and the largest engine − trainer
log-prob difference of the bf16 tokens (the kernels' own change shows as a change of it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from common import commit, log, write_json

from hobson.errors import ConfigError
from hobson.models import skinny

ROOT = Path(__file__).resolve().parent.parent
# --variants key: (label, use the route table)
VARIANTS = {"cublas": ("cuBLAS", False), "routes": ("routes", True)}


def pick_routes(skinny: dict, margin: float) -> list[dict]:
    """Per shape, the fastest timed choice that beats cuBLAS by ``margin`` (Triton only if it repeated its bits)."""
    routes = []
    for e in skinny["shapes"]:
        if e["dtype"] == "float32":  # fp32 products have their own kernel (skinny.plan), no route
            continue
        ks = {k: v["us"] for k, v in e["kernels"].items()
              if "us" in v and (not k.startswith("triton") or v.get("repeat_identical"))}
        if "cublas" not in ks:
            continue
        best = min(ks, key=ks.get)
        if ks[best] < (1 - margin) * ks["cublas"]:
            routes.append({"n": e["n"], "k": e["k"], "dtype": e["dtype"], "route": best,
                           "us": ks[best], "cublas_us": ks["cublas"]})
    return routes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--models", default="nanbeige,huginn_raven")
    p.add_argument("--margin", type=float, default=0.03, help="how much faster than cuBLAS a route must be")
    p.add_argument("--sweep-deadline", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per rollout process")
    p.add_argument("--routes", help="a route table measured before (skips the sweep)")
    p.add_argument("--variants", default="cublas,routes", help="any of cublas, routes")
    p.add_argument("--rollout-args", default="",
                   help="more arguments for each bench/rl_gpu.py run (e.g. '--size tiny --device cpu "
                        "--engine-device cpu --batch 2': the CPU test of this bench's plumbing)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per variant, interleaved (c r c r ...): the table shows the fastest and the spread")
    args = p.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    variants = [VARIANTS[k] for k in args.variants.split(",")]
    models = args.models.split(",")
    work = Path(tempfile.mkdtemp(prefix="decode-routes-"))
    env = dict(os.environ)  # hobson is installed (pip install -e .) or on the caller's PYTHONPATH
    skinny_models = ",".join("huginn" if m == "huginn_raven" else m for m in models)
    if args.routes:
        try:  # the models' own check: a bad table is one error naming the file and entry, before any run
            skinny.read_routes(args.routes)
        except ConfigError as e:
            p.error(f"--routes: {e}")
        routes = json.loads(Path(args.routes).read_text())
    else:
        subprocess.run([sys.executable, str(ROOT / "bench" / "skinny_gemm.py"), "--models", skinny_models,
                        "--dtypes", "bfloat16", "--sweep", "--sweep-deadline", str(args.sweep_deadline),
                        "--json", str(work / "skinny.json")], env=env, check=True)
        routes = pick_routes(json.loads((work / "skinny.json").read_text()), args.margin)
    table = work / "routes.json"
    table.write_text(json.dumps(routes, indent=1))
    log(f"{len(routes)} routes: " + ", ".join(f"{r['n']}x{r['k']} {r['route']}" for r in routes))
    res: dict = {"bench": "decode_routes", "command": ["python", "bench/decode_routes.py", *sys.argv[1:]],
                 "commit": commit(), "routes": routes, "rows": []}
    for model in models:
        for run, (label, use_routes) in ((i, v) for i in range(args.repeat) for v in variants):
            out = work / f"{model}-{len(res['rows'])}.json"
            venv = dict(env, HOBSON_GEMM16_ROUTES=str(table) if use_routes else "none")
            try:
                subprocess.run([sys.executable, str(ROOT / "bench" / "rl_gpu.py"), "--kind", model,
                                "--parts", "rollout", "--rollout-dtype", "bfloat16", "--engines", "now",
                                "--native-only", "--json", str(out), *shlex.split(args.rollout_args)],
                               env=venv, check=True, timeout=args.timeout)
                r = json.loads(out.read_text())
            except (subprocess.SubprocessError, OSError, ValueError) as e:  # a variant that fails is reported
                res["rows"].append({"model": model, "variant": label, "error": repr(e)[:300]})
                continue
            ro = r["rollout"]
            res["machine"] = r.get("machine")
            gaps = ro.get("engine_vs_trainer_logprob_gap") or {}
            res["rows"].append({"model": model, "variant": label, "run": run,
                                "decode_ms_per_step": ro["decode_ms_per_step"],
                                "engine_vs_trainer_logprob_gap": max(gaps.values(), default=None)})
            if args.json:
                write_json(args.json, res)
    gpu = (res.get("machine") or {}).get("gpu")
    print(f"\n### Decode, bf16, {gpu}: 16-bit GEMM routes"
          f" ({args.repeat} interleaved run(s) each)\n")
    print("| model | variant | decode ms/step, fastest run | all runs | cuBLAS / this (fastest) | "
          "max abs. log-prob gap to the eager trainer (bf16) |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    res["table"] = summarize(res["rows"])
    for row in res["table"]:
        gap = row["engine_vs_trainer_logprob_gap"]
        runs = ", ".join(f"{v:.2f}" for v in row["runs"]) + (f" ({row['errors']} failed)" if row["errors"] else "")
        print(f"| {row['model']} | {row['variant']} | {row['decode_ms_per_step']:.2f} | {runs} | "
              f"{row['vs_cublas']:.2f}× | {gap if gap is None else f'{gap:.1e}'} |")
    if args.json:
        write_json(args.json, res)


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (model, variant): the fastest run's ms/step (a run is slowed, never sped up, by
    what else the machine does), every run's, and the ratio to the fastest cuBLAS run of the model."""
    table: dict = {}
    for r in rows:
        t = table.setdefault((r["model"], r["variant"]), {"model": r["model"], "variant": r["variant"], "runs": [],
                                                         "errors": 0, "engine_vs_trainer_logprob_gap": None})
        if "error" in r:
            t["errors"] += 1
            continue
        t["runs"].append(r["decode_ms_per_step"])
        g = r["engine_vs_trainer_logprob_gap"]
        if g is not None:
            t["engine_vs_trainer_logprob_gap"] = max(g, t["engine_vs_trainer_logprob_gap"] or 0.0)
    out = []
    for t in table.values():
        t["decode_ms_per_step"] = min(t["runs"], default=float("nan"))
        base = table.get((t["model"], "cuBLAS"))
        t["vs_cublas"] = (min(base["runs"]) / t["decode_ms_per_step"]) if base and base["runs"] and t["runs"] \
            else float("nan")
        out.append(t)
    return out


if __name__ == "__main__":
    main()
