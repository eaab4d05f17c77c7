"""Compare two evaluated checkpoints: McNemar's exact test per task on paired predictions.

    python -m jobs.compare runs/A/eval runs/B/eval [--out runs/compare.json]

A and B are evaluation directories (or their predictions.jsonl files) made on the same eval files
and half. Prints a table: per task the rows, both accuracies, the discordant counts and the
two-sided exact McNemar p-value; --out also writes it as JSON.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A", help="evaluation directory or predictions.jsonl of checkpoint A")
    p.add_argument("b", metavar="B", help="evaluation directory or predictions.jsonl of checkpoint B")
    p.add_argument("--out", help="also write the comparison as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from hobson.decider.compare import compare, format_comparison, read_predictions
        from hobson.io import write_json_atomic

        result = compare(read_predictions(args.a), read_predictions(args.b))
        if args.out:
            write_json_atomic(args.out, result)
    except HobsonError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 1
    print(format_comparison(result, args.a, args.b), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
