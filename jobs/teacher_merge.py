"""Merge teacher (or replay) label shards into the one-process file, byte for byte; loads no model.

    python -m jobs.teacher_merge --out runs/R/teacher.jsonl --num-shards 8 \
        [--shift-by data/build.jsonl data/fetch.jsonl] [--expected-rows 12000]
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError
from hobson.labels.merge import MergeResult, merge_shards

__all__ = ["MergeResult", "main", "merge_shards"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.teacher_merge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True,
                   help="merged output path; reads <stem>.shard<i>of<N>.jsonl and their .done markers "
                        "beside it")
    p.add_argument("--num-shards", type=int, required=True, metavar="N", help="number of shards N to merge")
    p.add_argument("--shift-by", nargs="+", default=[], metavar="FILE",
                   help="training files that precede this one in the concatenated training set: also write "
                        "<out stem>_train.jsonl with indices offset by their total line count")
    p.add_argument("--expected-rows", type=int, metavar="M",
                   help="refuse unless the shards hold exactly rows 0..M-1 (e.g. the corpus's line count)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        res = merge_shards(args.out, args.num_shards, args.shift_by, args.expected_rows)
    except HobsonError as e:
        print(f"teacher-merge: error: {e}", file=sys.stderr)
        return 1
    print(f"teacher-merge: wrote {res.out} ({res.rows} rows from {args.num_shards} shards, "
          f"sha256 {res.sha256})")
    if res.train_out:
        print(f"teacher-merge: wrote {res.train_out} ({res.rows} rows, indices shifted by {res.shift}, "
              f"sha256 {res.train_sha256})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
