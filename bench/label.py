"""Labelling throughput: the batched labeller (``hobson.labels.label_rows``) against a naive loop.

    python bench/label.py --corpus runs/R/data/multistep/train.jsonl --teacher runs/R/models/teacher [--rows 512]
    python bench/label.py --corpus ... --checkpoint runs/R/parent/final      # the replay scorer

Scores the first ``--rows`` rows twice: batched (rows sorted by length, packed greedily, one forward
per batch, as the teacher/replay stages run) and naively (one forward per row, in file order).
Prints one JSON object: rows/s of both, their ratio, and the largest absolute difference between
the two runs' probabilities (padding must not change the answer beyond float noise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from hobson.corpus.schema import read_rows
from hobson.io import read_jsonl
from hobson.labels import label_rows
from hobson.labels.label import DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_TOKENS


def scorer_for(args: argparse.Namespace):
    if args.checkpoint:
        from hobson.decider.predict import DeciderScorer, load_decider

        return DeciderScorer(load_decider(args.checkpoint, args.device))
    from hobson.labels.lm_scorer import LMOptionScorer, load_causal_lm

    model, tok = load_causal_lm(args.teacher, args.device)
    return LMOptionScorer(model, tok, args.device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus JSONL file")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--teacher", help="local HF causal-LM directory (the teacher scorer)")
    g.add_argument("--checkpoint", help="decider checkpoint (the replay scorer)")
    p.add_argument("--rows", type=int, default=512, help="rows to score (default 512)")
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS)
    p.add_argument("--max-batch-rows", type=int, default=DEFAULT_MAX_BATCH_ROWS)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    import torch

    rows = read_rows(args.corpus)[: args.rows]
    scorer = scorer_for(args)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "labels.jsonl")
        start = time.perf_counter()
        label_rows(rows, scorer, out=out, max_batch_tokens=args.max_batch_tokens, max_batch_rows=args.max_batch_rows)
        batched_s = time.perf_counter() - start
        from hobson.shards import shard_paths

        batched = [x["probs"] for x in read_jsonl(shard_paths(out, 0, 1)[0])]
    start = time.perf_counter()
    with torch.inference_mode():
        naive = [scorer.score_batch([r])[0] for r in rows]
    naive_s = time.perf_counter() - start
    diff = max(abs(a - b) for pa, pb in zip(batched, naive, strict=True) for a, b in zip(pa, pb, strict=True))
    print(json.dumps({"rows": len(rows), "batched_rows_per_s": round(len(rows) / batched_s, 2),
                      "naive_rows_per_s": round(len(rows) / naive_s, 2), "speedup": round(naive_s / batched_s, 3),
                      "max_abs_prob_diff": round(diff, 7)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
