"""Evaluate a decider checkpoint: accuracy, ECE, NLL, Brier per kind and per task, paired sets.

    python -m jobs.evaluate --checkpoint runs/R/calibrated --out runs/R/eval \
        --eval-files runs/R/data/build/eval.jsonl ... \
        [--catchall runs/R/data/catchall/eval.jsonl] \
        [--consistency runs/R/data/generated/consistency.jsonl] [--flip runs/R/data/generated/flip.jsonl]

Writes <out>/report.json, report.md, predictions.jsonl and reliability.png, and prints the table.
By default it reports the test half (odd positions of the concatenated eval files), the rows
calibration did not see. Exit code 0 whatever the accuracy; --require-beats-majority P makes it 2
when the one-sided binomial p that accuracy beats the majority-class baseline is not below P.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="decider checkpoint directory")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--eval-files", nargs="+", required=True, metavar="FILE", help="eval corpus files, in order")
    p.add_argument("--half", default="test", choices=["test", "calib", "all"],
                   help="which rows: test = odd positions (default), calib = even, all")
    p.add_argument("--catchall", metavar="FILE", help="catch-all eval file, reported on its own")
    p.add_argument("--consistency", metavar="FILE", help="paraphrase-consistency pairs (rows with a pair key)")
    p.add_argument("--flip", metavar="FILE", help="instruction-flip pairs (rows with a pair key)")
    p.add_argument("--bins", type=int, default=10, help="confidence bins for ECE and the diagram (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per forward (default 32)")
    p.add_argument("--no-plot", action="store_true", help="skip reliability.png")
    p.add_argument("--require-beats-majority", type=float, metavar="P",
                   help="exit 2 unless the binomial p that accuracy beats the majority baseline is < P")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--base-model", help="torso directory replacing the one recorded in the checkpoint")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: env HOBSON_CPUS, else torch's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from hobson.decider.evaluate import evaluate_checkpoint, format_table
        from hobson.threads import set_threads

        set_threads(args.threads)
        report = evaluate_checkpoint(args.checkpoint, args.eval_files, args.out, device=args.device,
                                     base_model=args.base_model, plot=not args.no_plot, half=args.half,
                                     catchall=args.catchall, consistency=args.consistency, flip=args.flip,
                                     batch_size=args.batch_size, bins=args.bins)
    except HobsonError as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 1
    print(format_table(report))
    print(f"evaluate: report in {args.out}/report.md (json: report.json, predictions.jsonl"
          f"{'' if args.no_plot else ', reliability.png'})")
    o = report["overall"]
    if args.require_beats_majority is not None and not o["p_beats_majority"] < args.require_beats_majority:
        print(f"evaluate: accuracy {o['accuracy']:.4f} vs majority {o['majority_accuracy']:.4f}: "
              f"p {o['p_beats_majority']:.3g} is not below {args.require_beats_majority}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
