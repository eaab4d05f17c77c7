"""This checkout's code against another commit's, interleaved in one run on one card.

    python bench/ab_trees.py --base b316adb --kinds huginn_raven --parts rollout,fwd-bwd --repeat 2 \\
        --json bench/results/ab_trees-<date>.json
    python bench/ab_trees.py --base-tree /tmp/base ...   # a checkout extracted before (git archive REV)

What a change to the models or the engine is worth, each tree run as installed code: the base
commit is installed (``pip install --no-deps``) into a venv laid over this environment (its torch,
triton and the rest), this checkout runs from this environment's install; each run is its own
``bench/rl_gpu.py`` process (the bench scripts are this checkout's for both, so only the library
differs), the two trees alternating (base, new, base, new ...) so a drift of the machine's speed
shows in both. Per kind and part the table gives each tree's best run (a run is slowed, never sped
up, by what else the machine does), every run, and this tree's speed over the base's:

- ``rollout``: decode ms per step of the native engine (``--rollout-dtype bfloat16 --engines now
  --native-only``, B = 16, 128 prompt + 48 new tokens) and the engine − trainer log-prob gap;
- ``fwd-bwd`` (Huginn): tokens/s of the forward+backward with 24 no-grad + 8 grad recurrences,
  its fastest row (latents given, fused).

Where this checkout is not installed (a lent GPU machine's copy), run the bench with this
checkout's ``src`` on ``PYTHONPATH``; the base's runs go without it. ``--base REV`` extracts
``git archive REV`` into a temporary directory (a GPU machine's copy of the tree may lack the
history: extract beforehand and pass ``--base-tree``). Each run's JSON records
where it imported hobson from (``machine.hobson_src``); a run whose import came from elsewhere is
an error, not a row. One JSON file holds every run's figures, so a copy of the results is one file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import site
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
    """``git archive rev`` unpacked into ``into``."""
    tar = into.parent / "base.tar"
    with tar.open("wb") as f:
        r = subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=f, stderr=subprocess.PIPE)
    if r.returncode != 0:
        raise SystemExit(f"--base {rev}: git archive failed ({r.stderr.decode(errors='replace').strip()}); "
                         "extract the tree elsewhere and pass --base-tree")
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into


def install(tree: Path, venv: Path) -> Path:
    """``tree`` installed (not editable, no dependencies) into a new venv over this environment's
    packages; the venv's python. A venv made from inside another venv sees the base interpreter's
    packages, not this one's: a .pth file names this environment's site-packages (directories
    only: their own .pth files, such as an editable install of this checkout, are not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    outer = [d for d in site.getsitepackages() if Path(d).is_dir()]
    (Path(purelib) / "ab-trees-outer-environment.pth").write_text("\n".join(outer) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", str(tree)], check=True)
    return py


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
    g.add_argument("--base", help="the commit to compare against (git archive REV)")
    g.add_argument("--base-tree", help="that commit's tree (setup.py at its root), extracted before")
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
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: at least 1")
    if args.base_tree:
        tree = Path(args.base_tree).resolve()
        if not (tree / "setup.py").is_file() or not (tree / "src" / "hobson" / "__init__.py").is_file():
            p.error(f"--base-tree {args.base_tree}: not a hobson tree (want setup.py and src/hobson at its root)")
    work = Path(tempfile.mkdtemp(prefix="ab-trees-"))
    try:  # the base tree, its venv and the runs' files are removed however the bench ends (all is in the JSON)
        run_all(args, kinds, parts, work, tree if args.base_tree else extract(args.base, work / "base"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_all(args: argparse.Namespace, kinds: list[str], parts: list[str], work: Path, tree: Path) -> None:
    """Install the base, run both trees alternating, print the table and write the JSON."""
    log(f"installing the base ({tree}) into {work / 'venv'}")
    try:
        base_py = install(tree, work / "venv")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"installing the base tree {tree} failed: {e}") from None
    # each tree's interpreter, its label, and where its hobson must come from
    trees = {"base": (base_py, args.base or f"tree at {tree}", work / "venv"),
             "new": (Path(sys.executable), commit(), ROOT / "src")}
    res: dict = {"bench": "ab_trees", "command": ["python", "bench/ab_trees.py", *sys.argv[1:]],
                 "commit": commit(), "base": trees["base"][1], "rows": []}
    t0 = time.monotonic()
    for kind in kinds:
        for part in parts:
            for run in range(args.repeat):
                for tree, (py, rev, home) in trees.items():
                    if args.deadline and time.monotonic() - t0 > args.deadline:
                        log(f"deadline: {kind} {part} {tree} run {run} not started")
                        res["rows"].append({"kind": kind, "part": part, "tree": tree, "run": run,
                                            "error": "not started (deadline)"})
                        continue
                    out = work / f"{kind}-{part}-{tree}-{run}.json"
                    env = dict(os.environ, HOBSON_BENCH_COMMIT=str(rev))
                    if tree == "base":  # its install alone: a caller's path to this checkout would shadow it
                        env.pop("PYTHONPATH", None)
                    cmd = [str(py), str(ROOT / "bench" / "rl_gpu.py"), "--kind", kind, *PARTS[part],
                           "--json", str(out), *shlex.split(args.rollout_args)]
                    log(f"{kind} {part} {tree} run {run}")
                    try:
                        subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
                        r = json.loads(out.read_text())
                        ran = (r.get("machine") or {}).get("hobson_src")
                        if ran is None or not Path(ran).resolve().is_relative_to(home.resolve()):
                            raise RuntimeError(f"the run imported hobson from {ran}, not from {home}")
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
