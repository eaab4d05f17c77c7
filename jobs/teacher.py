"""Teacher labelling: one shard of a frozen causal LM's option probabilities for a corpus file.

    python -m jobs.teacher --corpus data/multistep.jsonl --out runs/R/teacher.jsonl \
        --num-shards 8 --shards 0-7 --task-index 3

writes ``runs/R/teacher.shard<k>of8.jsonl`` and its ``.done`` for shard k = shards[3]; run
``python -m jobs.teacher_merge`` afterwards. With one shard (the default) it also writes ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hobson.corpus.schema import read_rows
from hobson.corpus.sums import SUMS_NAME, verify_corpus
from hobson.errors import ConfigError, HobsonError
from hobson.labels import check_option_counts, label_rows, merge_shards, render_prompt, shard_done
from hobson.labels.label import DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_TOKENS
from hobson.progress import reporter
from hobson.shards import parse_spec, shard_paths, task_shard


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.teacher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus JSONL file to label (row i = line i+1)")
    p.add_argument("--out", required=True,
                   help="merged output path, e.g. runs/R/teacher.jsonl; shards are written beside it as "
                        "<stem>.shard<i>of<N>.jsonl plus .done markers")
    p.add_argument("--teacher", metavar="MODEL_DIR",
                   help="local Hugging Face causal-LM directory (no download); "
                        "default: the embedded tiny teacher")
    p.add_argument("--default-teacher-dir", metavar="DIR",
                   help="where the embedded tiny teacher is built once and reused "
                        "(default: <dirname of --out>/models/teacher)")
    p.add_argument("--num-shards", type=int, default=1, metavar="N",
                   help="total shards N; shard i labels the batches b with b %% N == i (default 1)")
    p.add_argument("--shards", metavar="SPEC",
                   help="shards this array runs, e.g. '0-7' or '1,3,5' (default: all of 0..N-1)")
    p.add_argument("--task-index", type=int, metavar="K",
                   help="array task index: runs shard SPEC[K] (default: env HOBSON_ARRAY_TASK)")
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, metavar="T",
                   help="token budget per batch, counted as rows x longest row "
                        f"(default {DEFAULT_MAX_BATCH_TOKENS})")
    p.add_argument("--max-batch-rows", type=int, default=DEFAULT_MAX_BATCH_ROWS, metavar="R",
                   help=f"at most R rows per batch (default {DEFAULT_MAX_BATCH_ROWS})")
    p.add_argument("--threads", type=int, metavar="T",
                   help="torch CPU threads (default: env HOBSON_CPUS, else torch's default)")
    p.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="teacher weights' dtype (default float32; the letters' softmax is always fp32)")
    return p


def _load_teacher(args: argparse.Namespace, rows: list[dict]) -> tuple[object, object]:
    from transformers.utils import logging as hf_logging

    from hobson.labels.lm_scorer import load_causal_lm

    hf_logging.disable_progress_bar()  # per-file bars would flood every array task's log
    if args.teacher:
        return load_causal_lm(args.teacher, args.device, args.dtype)
    from hobson.tinymodel import ensure_default_teacher

    model_dir = args.default_teacher_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "models",
                                                         "teacher")
    # The tokenizer is trained on exactly the prompts it will read.
    model_dir = ensure_default_teacher(model_dir, [render_prompt(r) for r in rows])
    print(f"teacher: default teacher at {model_dir}", flush=True)
    return load_causal_lm(model_dir, args.device, args.dtype)


def _verify_corpus(corpus: str) -> None:
    """Check ``<data>/<stage>/<file>`` against ``<data>/<stage>/SHA256SUMS`` when the stage wrote one."""
    path = Path(corpus)
    if not (path.parent / SUMS_NAME).is_file():
        print(f"teacher: no {SUMS_NAME} beside {corpus}: labelling it unverified", flush=True)
        return
    verify_corpus(path.parent.parent, [f"{path.parent.name}/{path.name}"])


def run(args: argparse.Namespace) -> int:
    n = args.num_shards
    shards = parse_spec(args.shards) if args.shards else list(range(n))
    shard = task_shard(shards, args.task_index)
    if not 0 <= shard < n:
        raise ConfigError(f"shard {shard} is outside --num-shards {n}")
    path, _ = shard_paths(args.out, shard, n)
    if shard_done(args.out, shard, n):
        print(f"teacher: shard {shard} of {n} already done: {path}", flush=True)
    else:
        _verify_corpus(args.corpus)
        rows = read_rows(args.corpus)
        check_option_counts(rows, args.corpus)
        from hobson.threads import set_threads

        set_threads(args.threads)
        from hobson.labels.lm_scorer import LMOptionScorer

        model, tokenizer = _load_teacher(args, rows)
        scorer = LMOptionScorer(model, tokenizer, args.device)
        res = label_rows(rows, scorer, out=args.out, shard=shard, num_shards=n,
                         max_batch_tokens=args.max_batch_tokens, max_batch_rows=args.max_batch_rows,
                         on_batch=reporter(f"teacher shard {shard} batches"))
        print(f"teacher: shard {shard} of {n}: wrote {res.path} ({res.rows} of {len(rows)} rows, "
              f"{res.batches} batches, sha256 {res.sha256})", flush=True)
    if n == 1:
        merged = merge_shards(args.out, 1)
        print(f"teacher: wrote {merged.out} ({merged.rows} rows, sha256 {merged.sha256})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except HobsonError as e:
        print(f"teacher: error: {e}", file=sys.stderr)
        return 1



if __name__ == "__main__":
    sys.exit(main())
