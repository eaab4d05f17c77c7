"""Held-out evaluation of an RL run (every publication version) or of one publication.

    python -m jobs.rl_eval runs/huginn-grpo --data held_out.jsonl          # every version
    python -m jobs.rl_eval runs/huginn-grpo/publications/v000010 --data held_out.jsonl

Each prompt is answered greedily (temperature 0) and scored with the run's reward (default
``math``: the last \\boxed{} against ``label``). Prints, per version, mean reward, accuracy and
the share of answers in \\boxed{}; writes ``rl_eval.json`` (with each prompt's outcome) and
``rl_eval.png`` (accuracy per version) to ``--out`` (default: ``<run>/eval``).

Exit codes: 0 done, 1 bad input (a missing run or publication, malformed data).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hobson.errors import HobsonError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.rl_eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="an RL run directory (its publications/) or one publication directory")
    p.add_argument("--data", required=True, help="JSONL with string 'prompt' and 'label' per row")
    p.add_argument("--out", help="where rl_eval.json and rl_eval.png go (default <run>/eval)")
    p.add_argument("--versions", type=int, nargs="*", help="only these publication versions")
    p.add_argument("--reward", help="reward name (default: the run's, else math)")
    p.add_argument("--max-new-tokens", type=int, help="answer length limit (default: the run's, else 48)")
    p.add_argument("--device", default="cpu", help="device of the engine (cpu, cuda:0)")
    args = p.parse_args(argv)
    try:
        from hobson.rl.evaluate import evaluate, write_report

        path = Path(args.path)
        results = evaluate(path, args.data, versions=args.versions, reward=args.reward,
                           max_new_tokens=args.max_new_tokens, device=args.device)
        if args.out:
            out = Path(args.out)
        elif (path / "publications").is_dir():
            out = path / "eval"
        else:  # one publication: beside its run, never inside the verified directory
            out = path.parent.parent / "eval" if (path.parent.parent / "run.json").is_file() else Path("rl_eval")
        js, png = write_report(results, out, title=str(path))
        print(f"rl_eval: wrote {js} and {png}")
        return 0
    except HobsonError as e:
        print(f"rl_eval: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
