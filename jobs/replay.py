"""Replay labelling: one shard of a decider checkpoint's own option distributions on a corpus file.

    python -m jobs.replay --checkpoint runs/R/parent/final --corpus runs/R/data/multistep/train.jsonl \
        --out runs/R/labels/replay.jsonl --num-shards 8 --shards 0-7 --task-index 3

writes ``runs/R/labels/replay.shard<k>of8.jsonl`` and its ``.done`` for shard k = shards[3], in the
teacher's format (``{"i": row, "probs": [...]}``, canonical option order, six decimals); merge with
``python -m jobs.teacher_merge --out runs/R/labels/replay.jsonl --num-shards 8 --shift-by ...``
exactly as the teacher's shards. With one shard (the default) it also writes ``--out``.

Batching and sharding are the teacher's (``hobson.labels``): rows sorted by their rendered token
length, packed greedily, shard i scores batches b with b % N == i; so the merged file is byte for
byte the one-process file. The probabilities are the checkpoint's raw softmax (temperature 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hobson.errors import ConfigError, HobsonError


def _parser() -> argparse.ArgumentParser:
    from hobson.labels.label import DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_TOKENS

    p = argparse.ArgumentParser(prog="python -m jobs.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="decider checkpoint directory (the parent's final/)")
    p.add_argument("--corpus", required=True, help="corpus JSONL file to label (row i = line i+1)")
    p.add_argument("--out", required=True,
                   help="merged output path, e.g. runs/R/labels/replay.jsonl; shards are written beside it")
    p.add_argument("--num-shards", type=int, default=1, metavar="N",
                   help="total shards N; shard i labels the batches b with b %% N == i (default 1)")
    p.add_argument("--shards", metavar="SPEC",
                   help="shards this array runs, e.g. '0-7' or '1,3,5' (default: all of 0..N-1)")
    p.add_argument("--task-index", type=int, metavar="K",
                   help="array task index: runs shard SPEC[K] (default: env HOBSON_ARRAY_TASK)")
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, metavar="T",
                   help=f"token budget per batch, rows x longest row (default {DEFAULT_MAX_BATCH_TOKENS})")
    p.add_argument("--max-batch-rows", type=int, default=DEFAULT_MAX_BATCH_ROWS, metavar="R",
                   help=f"at most R rows per batch (default {DEFAULT_MAX_BATCH_ROWS})")
    p.add_argument("--base-model", help="torso directory replacing the one recorded in the checkpoint")
    p.add_argument("--threads", type=int, metavar="T",
                   help="torch CPU threads (default: env HOBSON_CPUS, else torch's default)")
    p.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default cpu)")
    return p


def _verify_corpus(corpus: str) -> None:
    from hobson.corpus.sums import SUMS_NAME, verify_corpus

    path = Path(corpus)
    if (path.parent / SUMS_NAME).is_file():
        verify_corpus(path.parent.parent, [f"{path.parent.name}/{path.name}"])
    else:
        print(f"replay: no {SUMS_NAME} beside {corpus}: labelling it unverified", flush=True)


def run(args: argparse.Namespace) -> int:
    from hobson.corpus.schema import read_rows
    from hobson.labels import label_rows, merge_shards, shard_done
    from hobson.progress import reporter
    from hobson.shards import parse_spec, shard_paths, task_shard

    n = args.num_shards
    shards = parse_spec(args.shards) if args.shards else list(range(n))
    shard = task_shard(shards, args.task_index)
    if not 0 <= shard < n:
        raise ConfigError(f"shard {shard} is outside --num-shards {n}")
    path, _ = shard_paths(args.out, shard, n)
    if shard_done(args.out, shard, n):
        print(f"replay: shard {shard} of {n} already done: {path}", flush=True)
    else:
        from hobson.decider.predict import DeciderScorer, check_rows_fit, load_decider
        from hobson.threads import set_threads

        _verify_corpus(args.corpus)
        rows = read_rows(args.corpus)
        set_threads(args.threads)
        loaded = load_decider(args.checkpoint, args.device, args.base_model)
        check_rows_fit(rows, loaded.config, args.corpus)
        res = label_rows(rows, DeciderScorer(loaded), out=args.out, shard=shard, num_shards=n,
                         max_batch_tokens=args.max_batch_tokens, max_batch_rows=args.max_batch_rows,
                         on_batch=reporter(f"replay shard {shard} batches"))
        print(f"replay: shard {shard} of {n}: wrote {res.path} ({res.rows} of {len(rows)} rows, "
              f"{res.batches} batches, sha256 {res.sha256})", flush=True)
    if n == 1:
        merged = merge_shards(args.out, 1)
        print(f"replay: wrote {merged.out} ({merged.rows} rows, sha256 {merged.sha256})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except HobsonError as e:
        print(f"replay: error: {e}", file=sys.stderr)
        return 1



if __name__ == "__main__":
    sys.exit(main())
