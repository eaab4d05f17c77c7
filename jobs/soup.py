"""Soup decider checkpoints: one checkpoint whose LoRA update and head logits are their means.

    python -m jobs.soup runs/R/seed0/final runs/R/seed1/final runs/R/seed2/final --out runs/R/soup

LoRA A matrices are stacked, B matrices concatenated and divided by N (rank N*r, alpha N*alpha:
the mean update), heads kept side by side with averaged logits. Checkpoints whose configs differ
in any key except seeds and run control are refused, naming the keys. Temperatures reset to 1.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.soup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="decider checkpoint directories (two or more)")
    p.add_argument("--out", required=True, help="soup checkpoint directory to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from hobson.decider.soup import soup_checkpoints

        out = soup_checkpoints(args.checkpoints, args.out)
    except HobsonError as e:
        print(f"soup: error: {e}", file=sys.stderr)
        return 1
    print(f"soup: wrote {out} (soup of {len(args.checkpoints)} checkpoints; temperatures reset to 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
