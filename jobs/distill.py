"""Build the final model's teacher file: teacher rows that agree with gold, then replay rows.

    python -m jobs.distill --train-files runs/R/data/build/train.jsonl ... runs/R/data/catchall/train.jsonl \
        --teacher runs/R/labels/teacher_train.jsonl --replay runs/R/labels/replay_train.jsonl \
        --out runs/R/labels/final_teacher.jsonl

Label files must be in the training-row index space (the ``*_train.jsonl`` files the merge wrote
with --shift-by). Kept: each teacher line whose argmax equals the row's gold label (bytes
unchanged, in order); appended: each replay line for a row without a kept teacher line. The final
model then trains from this file (``teacher_files`` in configs/train.yaml) without a parent.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-files", nargs="+", required=True, metavar="FILE",
                   help="the training corpus files, in the training set's order (gold labels, index space)")
    p.add_argument("--teacher", nargs="*", default=[], metavar="FILE", help="teacher label files (shifted)")
    p.add_argument("--replay", nargs="*", default=[], metavar="FILE", help="replay label files (shifted)")
    p.add_argument("--out", required=True, help="the final teacher file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from hobson.decider.distill import distill

        r = distill(args.train_files, args.teacher, args.replay, args.out)
    except HobsonError as e:
        print(f"distill: error: {e}", file=sys.stderr)
        return 1
    print(f"distill: wrote {r.out} ({r.rows} rows: {r.teacher_kept} of {r.teacher_rows} teacher rows agree with "
          f"gold, {r.replay_appended} of {r.replay_rows} replay rows appended; sha256 {r.sha256})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
