"""This checkout's code against another commit's, interleaved in one run on one card.

    python bench/ab_trees.py --base b316adb --kinds huginn_raven --parts rollout,fwd-bwd --repeat 2 \\
        --json bench/results/ab_trees-<date>.json
    python bench/ab_trees.py --base-src /tmp/base/src ...   # a tree extracted before (git archive REV src)

What a change to the models or the engine is worth: each run is its own ``bench/rl_gpu.py``
process with ``PYTHONPATH`` at one tree's ``src/`` (the bench scripts are this checkout's for both,
so only the library differs), the two trees alternating (base, new, base, new ...) so a drift of
the machine's speed shows in both. Per kind and part the table gives each tree's best run (a run is
slowed, never sped up, by what else the machine does), every run, and this tree's speed over the
base's:

- ``rollout``: decode ms per step of the native engine (``--rollout-dtype bfloat16 --engines now
  --native-only``, B = 16, 128 prompt + 48 new tokens) and the engine − trainer log-prob gap;
- ``fwd-bwd`` (Huginn): tokens/s of the forward+backward with 24 no-grad + 8 grad recurrences,
  latents given, fused (its fastest row).

``--base REV`` extracts ``git archive REV src`` into a temporary directory (a GPU machine's copy
of the tree may lack the history: extract beforehand and pass ``--base-src``). Each run's JSON
records the tree it imported (``machine.hobson_src``); a run whose import came from elsewhere
(an installed hobson shadowing ``PYTHONPATH``) is an error, not a row. One JSON file holds every
run's figures, so a copy of the results is one file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common import commit, log, write_json

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"rollout": ["--parts", "rollout", "--rollout-dtype", "bfloat16", "--engines", "now", "--native-only"],
         "fwd-bwd": ["--parts", "fwd-bwd"]}


def extract(rev: str, into: Path) -> Path:
    """``git archive rev src`` unpacked under ``into``; its ``src`` directory."""
    tar = into / "base.tar"
    with tar.open("wb") as f:
        r = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=False)
    if r.returncode != 0:
        raise SystemExit(f"--base {rev}: git archive failed ({r.stderr.decode(errors='replace').strip()}); "
                         "extract the tree elsewhere and pass --base-src")
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def figure(part: str, res: dict) -> dict:
    """The run's figure: decode ms/step (lower is faster) or forward+backward tokens/s (higher)."""
    if part == "rollout":
        ro = res["rollout"]
        gaps = ro.get("engine_vs_trainer_logprob_gap") or {}
        return {"decode_ms_per_step": ro["decode_ms_per_step"],
                "engine_vs_trainer_logprob_gap": max(gaps.values(), default=None)}
    rows = res["fwd_bwd"]["rows"]
    best = max(rows, key=lambda k: rows[k]["tokens_per_s"])
    return {"tokens_per_s": rows[best]["tokens_per_s"], "row": best}


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (kind, part, tree): the best run, every run, and the speed over the base's best."""
    table: dict = {}
    for r in rows:
        t = table.setdefault((r["kind"], r["part"], r["tree"]),
                             {"kind": r["kind"], "part": r["part"], "tree": r["tree"], "runs": [], "errors": 0})
        if "error" in r:
            t["errors"] += 1
        else:
            t["runs"].append(r["decode_ms_per_step"] if r["part"] == "rollout" else r["tokens_per_s"])
    for t in table.values():
        lower = t["part"] == "rollout"
        t["best"] = (min if lower else max)(t["runs"], default=float("nan"))
    for t in table.values():
        base = table.get((t["kind"], t["part"], "base"))
        if not (base and base["runs"] and t["runs"]):
            t["speedup"] = float("nan")
        else:
            t["speedup"] = base["best"] / t["best"] if t["part"] == "rollout" else t["best"] / base["best"]
    return list(table.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--base", help="the commit to compare against (git archive REV src)")
    g.add_argument("--base-src", help="that commit's src/ directory, extracted before")
    p.add_argument("--kinds", default="huginn_raven", help="any of huginn_raven, nanbeige")
    p.add_argument("--parts", default="rollout", help="any of rollout, fwd-bwd (fwd-bwd: Huginn only)")
    p.add_argument("--repeat", type=int, default=2, help="runs per tree, interleaved")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--deadline", type=float, default=0.0, help="start no run after this many seconds (0: none)")
    p.add_argument("--json")
    p.add_argument("--rollout-args", default="",
                   help="more arguments for each bench/rl_gpu.py run (e.g. '--size tiny --device cpu "
                        "--engine-device cpu --batch 2': the CPU test of this bench's plumbing)")
    args = p.parse_args()
    kinds, parts = args.kinds.split(","), args.parts.split(",")
    bad = sorted(set(kinds) - {"huginn_raven", "nanbeige"}) + sorted(set(parts) - set(PARTS))
    if bad:
        p.error(f"unknown kinds or parts: {bad}")
    if "fwd-bwd" in parts and kinds != ["huginn_raven"]:
        p.error("--parts fwd-bwd is Huginn's: use --kinds huginn_raven")
    work = Path(tempfile.mkdtemp(prefix="ab-trees-"))
    if args.base:
        base_src = extract(args.base, work)
    else:
        base_src = Path(args.base_src).resolve()
        if not (base_src / "hobson" / "__init__.py").is_file():
            p.error(f"--base-src {args.base_src}: no hobson package under it (want a tree's src/ directory)")
    trees = {"base": (base_src, args.base or f"src at {base_src}"), "new": (ROOT / "src", commit())}
    res: dict = {"bench": "ab_trees", "command": ["python", "bench/ab_trees.py", *sys.argv[1:]],
                 "commit": commit(), "base": trees["base"][1], "rows": []}
    t0 = time.monotonic()
    for kind in kinds:
        for part in parts:
            for run in range(args.repeat):
                for tree, (src, rev) in trees.items():
                    if args.deadline and time.monotonic() - t0 > args.deadline:
                        log(f"deadline: {kind} {part} {tree} run {run} not started")
                        res["rows"].append({"kind": kind, "part": part, "tree": tree, "run": run,
                                            "error": "not started (deadline)"})
                        continue
                    out = work / f"{kind}-{part}-{tree}-{run}.json"
                    path = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
                    env = dict(os.environ, PYTHONPATH=path, HOBSON_BENCH_COMMIT=str(rev))
                    cmd = [sys.executable, str(ROOT / "bench" / "rl_gpu.py"), "--kind", kind, *PARTS[part],
                           "--json", str(out), *shlex.split(args.rollout_args)]
                    log(f"{kind} {part} {tree} run {run}")
                    try:
                        subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
                        r = json.loads(out.read_text())
                        ran = (r.get("machine") or {}).get("hobson_src")
                        if ran is None or Path(ran).resolve() != src.resolve():
                            raise RuntimeError(f"the run imported hobson from {ran}, not {src}")
                        row = {"kind": kind, "part": part, "tree": tree, "run": run, "hobson_src": ran,
                               **figure(part, r)}
                        res["machine"] = r.get("machine")
                    except (subprocess.SubprocessError, OSError, ValueError, KeyError, RuntimeError) as e:
                        row = {"kind": kind, "part": part, "tree": tree, "run": run, "error": repr(e)[:300]}
                    res["rows"].append(row)
                    if args.json:
                        write_json(args.json, res)
    res["table"] = summarize(res["rows"])
    gpu = (res.get("machine") or {}).get("gpu") or "CPU"
    print(f"\n### This tree ({res['commit']}) against {res['base']}, {gpu}, {args.repeat} interleaved run(s) each\n")
    print("| kind | part | tree | best run | all runs | speed over the base |\n| --- | --- | --- | ---: | --- | ---: |")
    for t in res["table"]:
        unit = "ms/step" if t["part"] == "rollout" else "tok/s"
        runs = ", ".join(f"{v:.2f}" for v in t["runs"]) + (f" ({t['errors']} failed)" if t["errors"] else "")
        print(f"| {t['kind']} | {t['part']} | {t['tree']} | {t['best']:.2f} {unit} | {runs} | {t['speedup']:.3f}× |")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
