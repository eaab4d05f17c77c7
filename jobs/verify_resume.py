"""Compare two RL runs bit for bit (uninterrupted vs stopped and resumed).

    python -m jobs.verify_resume runs/grpo-full runs/grpo-resumed

Prints one line per compared item (full actor/critic parameters, optimizer, scheduler, loss
scaler and RNG state, data cursor and publication version of every checkpoint; tokens,
behaviour log-probs, rewards, latent traces and (version, digest) of every rollout; publication
digests), each "equal" or the first difference. Exit 0 if everything is equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jobs.verify_resume", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_a", help="output directory of the first run (e.g. uninterrupted)")
    p.add_argument("run_b", help="output directory of the second run (e.g. --stop-after then --resume)")
    args = p.parse_args(argv)
    try:
        from hobson.rl.verify_resume import compare_runs

        items = compare_runs(args.run_a, args.run_b)
    except HobsonError as e:
        print(f"verify_resume: error: {e}", file=sys.stderr)
        return 1
    for item in items:
        print(item.line())
    bad = [i for i in items if i.difference is not None]
    print(f"{len(items) - len(bad)} equal, {len(bad)} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
