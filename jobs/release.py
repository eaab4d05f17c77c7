"""The release route's last steps: soup the seed checkpoints, calibrate the soup, evaluate it.

    python -m jobs.release runs/R/seed0/final runs/R/seed1/final runs/R/seed2/final --out runs/R/release \
        --eval-files runs/R/data/build/eval.jsonl ... [--catchall F] [--consistency F] [--flip F]

writes <out>/soup, <out>/calibrated and <out>/eval (report.json, report.md, predictions.jsonl,
reliability.png), and prints the evaluation table. The same as jobs.soup, jobs.calibrate --out and
jobs.evaluate in a row.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.release", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="the seed runs' final checkpoints (two or more)")
    p.add_argument("--out", required=True, help="release directory (soup/, calibrated/, eval/)")
    p.add_argument("--eval-files", nargs="+", required=True, metavar="FILE", help="eval corpus files, in order")
    p.add_argument("--catchall", metavar="FILE", help="catch-all eval file")
    p.add_argument("--consistency", metavar="FILE", help="paraphrase-consistency pairs")
    p.add_argument("--flip", metavar="FILE", help="instruction-flip pairs")
    p.add_argument("--min-kind-rows", type=int, default=100, metavar="N",
                   help="per-kind temperature for kinds with >= N calibration rows (default 100)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per forward (default 32)")
    p.add_argument("--no-plot", action="store_true", help="skip reliability.png")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: env HOBSON_CPUS, else torch's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from hobson.decider.evaluate import format_table
        from hobson.decider.release import release
        from hobson.threads import set_threads

        set_threads(args.threads)
        report = release(args.checkpoints, args.eval_files, args.out, catchall=args.catchall,
                         consistency=args.consistency, flip=args.flip, min_kind_rows=args.min_kind_rows,
                         batch_size=args.batch_size, device=args.device, plot=not args.no_plot)
    except HobsonError as e:
        print(f"release: error: {e}", file=sys.stderr)
        return 1
    print(format_table(report))
    print(f"release: soup in {args.out}/soup, calibrated copy in {args.out}/calibrated, report in {args.out}/eval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
