"""Fit a decider checkpoint's temperatures on the calibration half of the eval rows.

    python -m jobs.calibrate --checkpoint runs/R/train/final \
        --eval-files runs/R/data/build/eval.jsonl runs/R/data/multistep/eval.jsonl ... \
        [--out runs/R/calibrated] [--min-kind-rows 100]

The calibration half is the even positions of the concatenated eval files (evaluation reports on
the odd ones). One global temperature by NLL, plus one per kind with at least --min-kind-rows rows
there. Without --out, ``temperatures.json`` in the checkpoint is replaced atomically; with --out, a
calibrated copy of the checkpoint is written there (atomically, as a whole directory).
"""

from __future__ import annotations

import argparse
import json
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    from hobson.decider.calibrate import DEFAULT_MIN_KIND_ROWS

    p = argparse.ArgumentParser(prog="python -m jobs.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="decider checkpoint directory (e.g. <output_dir>/final)")
    p.add_argument("--eval-files", nargs="+", required=True, metavar="FILE",
                   help="eval corpus files, concatenated in this order; even positions are the calibration half")
    p.add_argument("--out", help="write a calibrated copy of the checkpoint here instead of updating it in place")
    p.add_argument("--min-kind-rows", type=int, default=DEFAULT_MIN_KIND_ROWS, metavar="N",
                   help=f"fit a per-kind temperature for kinds with >= N calibration rows (default "
                        f"{DEFAULT_MIN_KIND_ROWS})")
    p.add_argument("--batch-size", type=int, default=32, help="rows per forward (default 32)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--base-model", help="torso directory replacing the one recorded in the checkpoint")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: env HOBSON_CPUS, else torch's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from hobson.decider.release import calibrate_checkpoint
        from hobson.threads import set_threads

        set_threads(args.threads)
        temps, path = calibrate_checkpoint(args.checkpoint, args.eval_files, out=args.out,
                                           min_kind_rows=args.min_kind_rows, batch_size=args.batch_size,
                                           device=args.device, base_model=args.base_model)
    except HobsonError as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 1
    print(f"calibrate: wrote {path}/temperatures.json: {json.dumps(temps, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
