"""Merge throughput: ``merge_shards`` on 10^6 teacher rows over 8 shards against ``cat`` of the same bytes.

    python bench/merge.py [--rows 1000000] [--shards 8] [--repeat 3]

Rows are teacher-style (2-7 six-decimal probabilities), cut as the teacher cuts them: a random
length order, batches of 64 in that order, shard s holding batches b % 8 == s, each shard sorted by
index. Both timings are the best of ``--repeat`` runs; the merge includes everything it checks
(``.done`` digests, index scan, overlaps and gaps) and writes the merged file atomically.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from common import best

from hobson.labels.merge import merge_shards
from hobson.labels.shardfile import format_label_line, write_shard
from hobson.shards import shard_paths


def make_shards(out: str, rows: int, shards: int, batch: int = 64, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    order = rng.permutation(rows)  # stands in for the shortest-first order
    n_opts = rng.integers(2, 8, size=rows)
    lines = []
    for i in range(rows):
        p = rng.random(n_opts[i]) + 1e-3
        lines.append(format_label_line(i, (p / p.sum()).tolist()))
    owner = np.empty(rows, dtype=np.int64)
    owner[order] = (np.arange(rows) // batch) % shards
    for s in range(shards):
        path, done = shard_paths(out, s, shards)
        write_shard(path, done, (lines[i] for i in np.flatnonzero(owner == s).tolist()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="total label rows (default 10^6)")
    p.add_argument("--shards", type=int, default=8, help="number of shards (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each; the best is reported (default 3)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hobson-bench-merge.") as d:
        out = os.path.join(d, "teacher.jsonl")
        t = time.perf_counter()
        make_shards(out, args.rows, args.shards)
        print(f"generated {args.rows} rows in {args.shards} shards in {time.perf_counter() - t:.1f} s")
        files = [shard_paths(out, s, args.shards)[0] for s in range(args.shards)]
        cat_out = os.path.join(d, "cat.jsonl")
        cmd = "cat " + " ".join(files) + f" > {cat_out}"
        t_cat = best(lambda: subprocess.run(cmd, shell=True, check=True), args.repeat)
        t_merge = best(lambda: merge_shards(out, args.shards), args.repeat)
        mb = os.path.getsize(out) / 1e6
        assert os.path.getsize(cat_out) == os.path.getsize(out)
        print(f"{'what':<8} {'rows':>9} {'MB':>8} {'seconds':>8} {'MB/s':>8}")
        for name, sec in (("cat", t_cat), ("merge", t_merge)):
            print(f"{name:<8} {args.rows:>9} {mb:>8.1f} {sec:>8.3f} {mb / sec:>8.0f}")
        print(f"ratio merge/cat: {t_merge / t_cat:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
