"""Compare two RL runs bit for bit (uninterrupted vs stopped and resumed).

    python -m jobs.verify_resume runs/grpo-full runs/grpo-resumed
    python -m jobs.verify_resume --record runs/grpo-full > full.json     # then rm -r runs/grpo-full
    python -m jobs.verify_resume full.json runs/grpo-resumed

Prints one line per compared item (full actor/critic parameters, optimizer, scheduler, loss
scaler and RNG state, data cursor and publication version of every checkpoint; tokens,
behaviour log-probs, rewards, latent traces and (version, digest) of every rollout; publication
digests), each "equal" or the first difference. Exit 0 if everything is equal, 1 otherwise.

``--record RUN`` writes the sha256 digests of all those items as JSON to stdout instead, so the
run's large files can be deleted before the other run starts; either argument of a comparison may
then be such a record. A record against a run gives each item the same verdict as the two runs;
its differences name the tensor, key or element digested, not the element inside a tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from hobson.errors import HobsonError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jobs.verify_resume", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--record", metavar="RUN", help="write RUN's digest record (JSON) to stdout and exit")
    p.add_argument("run_a", nargs="?", help="first run directory (e.g. uninterrupted) or its --record file")
    p.add_argument("run_b", nargs="?", help="second run directory (e.g. --stop-after then --resume) or a record")
    args = p.parse_args(argv)
    if args.record is not None and (args.run_a or args.run_b):
        p.error("--record RUN takes no other run")
    if args.record is None and not (args.run_a and args.run_b):
        p.error("give RUN_A RUN_B (run directories or --record files), or --record RUN")
    try:
        from hobson.rl.verify_resume import compare, record_run

        if args.record is not None:
            with contextlib.redirect_stdout(sys.stderr):  # warnings while loading must not mix into the JSON
                rec = record_run(args.record)
            json.dump(rec, sys.stdout, indent=None, separators=(",", ":"))
            sys.stdout.write("\n")
            return 0
        items = compare(args.run_a, args.run_b)
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
