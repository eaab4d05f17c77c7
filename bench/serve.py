"""The decider server under concurrent clients, against asking the checkpoint in one process.

    python bench/serve.py [--checkpoint runs/R/calibrated] [--rows runs/R/data/build/eval.jsonl] \\
        [--questions 512] [--clients 1,8,64] [--device cpu] [--threads 2] [--json out.json]

Without --checkpoint it takes the newest ``runs/*/calibrated`` (what the README's first command
leaves: the embedded tiny decider) and, without --rows, that run's eval rows. The baseline is what
a user would write without a server: one process that loaded the checkpoint and calls ``ask`` for
each question as it comes (one question per call). The server (``python -m jobs.serve``, its own
process, the same torch threads) is then asked the same questions by 1, 8 and 64 concurrent
clients, one question per HTTP request, each client with its own keep-alive connection. Printed:
questions per second, p50/p99 latency per question, and the ratio of questions per second to the
baseline's, all from this one run. The clients share the machine with the server, so on a small
CPU the figures include their cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import environment, write_json

REPO = Path(__file__).resolve().parents[1]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="decider checkpoint (default: the newest runs/*/calibrated)")
    p.add_argument("--rows", default=None, help="corpus rows to ask (default: that run's eval rows)")
    p.add_argument("--questions", type=int, default=512)
    p.add_argument("--clients", default="1,8,64")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the baseline and of the server")
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--json", default=None)
    return p.parse_args()


def _defaults(args: argparse.Namespace) -> tuple[Path, Path]:
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is None:
        found = sorted((REPO / "runs").glob("*/calibrated"), key=lambda p: p.stat().st_mtime)
        if not found:
            sys.exit("no runs/*/calibrated: run the README's first command (the recipe on its embedded default) "
                     "or pass --checkpoint")
        ckpt = found[-1]
    rows = Path(args.rows) if args.rows else ckpt.parent / "data" / "build" / "eval.jsonl"
    if not rows.is_file():
        sys.exit(f"no rows at {rows}: pass --rows FILE (corpus rows)")
    return ckpt, rows


def _quantiles(lat: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return q[49] * 1e3, q[98] * 1e3


def baseline(ckpt: Path, rows: list[dict], device: str, threads: int) -> dict:
    import torch

    from hobson.decider.ask import ask
    from hobson.decider.predict import load_decider

    torch.set_num_threads(threads)
    loaded = load_decider(ckpt, device)
    for r in rows[:8]:
        ask(loaded, [r])  # warm-up
    lat = []
    t0 = time.perf_counter()
    for r in rows:
        s = time.perf_counter()
        ask(loaded, [r])
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    p50, p99 = _quantiles(lat)
    return {"qps": len(rows) / wall, "p50_ms": p50, "p99_ms": p99, "wall_s": wall}


def _question(r: dict) -> dict:
    return {k: r[k] for k in ("state", "instructions", "options", "kind")}


def clients_run(url: str, rows: list[dict], n_clients: int) -> dict:
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(n_clients + 1)

    def client(k: int) -> None:
        mine = rows[k::n_clients]
        with httpx.Client(base_url=url, timeout=300) as c:
            c.get("/healthz")  # open the connection before the clock starts
            start.wait()
            for r in mine:
                s = time.perf_counter()
                resp = c.post("/v1/decide", json=_question(r))
                d = time.perf_counter() - s
                if resp.status_code != 200:
                    errors.append(resp.text)
                with lock:
                    lat.append(d)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    p50, p99 = _quantiles(lat)
    return {"qps": len(rows) / wall, "p50_ms": p50, "p99_ms": p99, "wall_s": wall}


def main() -> None:
    args = _args()
    ckpt, rows_file = _defaults(args)
    from hobson.io import read_jsonl

    source = read_jsonl(rows_file)
    rows = [source[i % len(source)] for i in range(args.questions)]
    result: dict = {"checkpoint": str(ckpt), "rows": str(rows_file), "questions": len(rows),
                    "threads": args.threads, "max_batch_tokens": args.max_batch_tokens,
                    "environment": environment(args.device)}
    base = baseline(ckpt, rows, args.device, args.threads)
    result["baseline"] = base
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    address = work / "address.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen([sys.executable, "-m", "jobs.serve", str(ckpt), "--port", "0", "--address-file",
                             str(address), "--threads", str(args.threads), "--device", args.device,
                             "--max-batch-tokens", str(args.max_batch_tokens), "--max-queue", "4096"],
                            cwd=REPO, env=env, stdout=(work / "server.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        while not address.exists():
            if proc.poll() is not None:
                raise SystemExit((work / "server.log").read_text())
            time.sleep(0.05)
        url = json.loads(address.read_text())["url"]
        with httpx.Client(base_url=url, timeout=120) as c:
            while c.get("/healthz").status_code != 200:
                time.sleep(0.05)
            for r in rows[:8]:
                c.post("/v1/decide", json=_question(r))  # warm-up
        result["server"] = {}
        for n in [int(x) for x in args.clients.split(",")]:
            result["server"][str(n)] = clients_run(url, rows, n)
        with httpx.Client(base_url=url, timeout=60) as c:
            result["server_stats"] = c.get("/healthz").json()["stats"]
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"\n### serve: {len(rows)} questions, {args.device}, {args.threads} torch threads ({ckpt})\n")
    print("| path | clients | questions/s | p50 ms | p99 ms | x one-process ask |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| one process, ask per question (baseline) | 1 | {base['qps']:.1f} | {base['p50_ms']:.1f} | "
          f"{base['p99_ms']:.1f} | 1.00 |")
    for n, r in result["server"].items():
        r["ratio"] = r["qps"] / base["qps"]
        print(f"| server, one question per request | {n} | {r['qps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
              f"{r['ratio']:.2f} |")
    s = result["server_stats"]
    print(f"\nserver: {s['forwards']} forwards for {s['questions']} questions; largest forward "
          f"{s['largest_forward_rows']} rows, {s['largest_forward_tokens']} tokens (cap {args.max_batch_tokens})")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
