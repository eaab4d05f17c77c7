"""Ask a decider checkpoint questions from the command line; prints calibrated probabilities.

    python -m jobs.ask runs/R/calibrated --state 'x = 3; y = 5' --choice 'Which is larger?=x,y,equal'

Each --choice 'QUESTION=opt1,opt2,...' is one question about --state (an option may carry a
description: 'opt:description'). The answer with the highest probability is marked with '*'.
With --server URL (or a serve run's directory) a running server answers instead of a checkpoint
loaded here: the same probabilities.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.ask", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", nargs="?", help="decider checkpoint directory (not with --server)")
    p.add_argument("--state", default="", help="the situation the questions are about (may be empty)")
    p.add_argument("--choice", action="append", required=True, metavar="'Q=a,b'",
                   help="a question and its comma-separated options; repeat for several questions")
    p.add_argument("--kind", default="choice", choices=["choice", "noul", "score"],
                   help="row kind (selects the per-kind temperature; default choice)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--base-model", help="torso directory replacing the one recorded in the checkpoint")
    p.add_argument("--server", metavar="URL", help="ask a running server (http://host:port, or the run directory "
                                                   "of a serve job) instead of loading CKPT")
    p.add_argument("--token-file", help="the server's bearer token (default $HOBSON_SERVE_TOKEN, or the one its "
                                        "serve job recorded)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.server is None):
        p.error("give a checkpoint directory CKPT or --server URL (one of them)")
    try:
        from hobson.decider.ask import ask, format_answers, parse_choice

        rows = [parse_choice(c, args.state, args.kind) for c in args.choice]
        if args.server:
            from hobson.serve.client import ask_server

            probs = ask_server(args.server, rows, args.token_file)
        else:
            from hobson.decider.predict import load_decider

            probs = ask(load_decider(args.checkpoint, args.device, args.base_model), rows)
        print(format_answers(rows, probs), end="")
    except HobsonError as e:
        print(f"ask: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
