"""Train the decider (the parent or the final model) from a YAML config.

    python -m jobs.train --config configs/train.yaml
    torchrun --nproc_per_node=8 -m jobs.train --config configs/train.yaml epochs=2 lr=1e-4

``key=value`` arguments override single config keys (values parse as YAML). With WORLD_SIZE > 1
(torchrun) every optimizer step trains the same rows in the same micro-batches as one process.
A run resumes from the newest checkpoint in ``<output_dir>/checkpoints`` (``resume=false`` to
start over). SIGUSR2 writes a checkpoint at the next step boundary, then exits 75 (``on_usr2:
exit``, requeue me) or keeps training (``on_usr2: continue``).

Exit codes: 0 done (or stopped after ``stop_after_steps`` with a checkpoint), 1 bad config or
data, 75 preempted by SIGUSR2 after writing a checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training config YAML, e.g. configs/train.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="override one config key (value parsed as YAML), e.g. lr=1e-4 resume=false")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from hobson.decider.config import load_train_config
        from hobson.decider.train import recipe_main

        return recipe_main(load_train_config(args.config, args.overrides))
    except HobsonError as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
