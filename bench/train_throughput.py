"""Decider training throughput: rows/s and tokens/s by length-grouping key, and without grouping, as ratios.

    python bench/train_throughput.py --config configs/train.yaml [--steps 20] [KEY=VALUE ...]

Runs the training recipe three times for ``--steps`` optimizer steps on this device (one process):
micro-batches grouped by token length (``length_group_by=tokens``, the default), grouped by the
character proxy (``length_group_by=chars``, the only key of earlier versions), and not grouped
(``length_group_chunk=1``: micro-batches in shuffled order). Reports for each, from the recipe's
``on_step`` hook: wall seconds of the steps (the sum of their seconds: model load and setup
excluded), rows/s, real tokens/s, padded tokens/s and the padding share, plus rows/s ratios
against the other two, as one JSON object on stdout. Outputs go to a temp dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from hobson.decider.config import load_train_config
from hobson.decider.train import DeciderTrainRecipe, StepStats


def run(config: str, overrides: list[str], steps: int) -> dict:
    """One recipe run of ``steps`` steps; the figures come from the recipe's ``on_step`` hook."""
    seen: list[StepStats] = []
    with tempfile.TemporaryDirectory() as out:
        cfg = load_train_config(config, [*overrides, f"output_dir={out}", f"stop_after_steps={steps}",
                                         "resume=false", "val_file=null", "checkpoint_every=0", "log_every=1000000"])
        recipe = DeciderTrainRecipe(cfg, on_step=seen.append)
        try:
            recipe.setup()
            recipe.train()
        finally:
            recipe.cleanup()
    wall = sum(s.seconds for s in seen)
    rows, tokens, padded = (sum(getattr(s, k) for s in seen) for k in ("rows", "tokens", "padded_tokens"))
    return {"wall_s": round(wall, 3), "rows": rows, "rows_per_s": round(rows / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "padded_tokens_per_s": round(padded / wall, 1),
            "padding_share": round(1 - tokens / max(padded, 1), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/train.yaml", help="training config (default configs/train.yaml)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (e.g. base_model=...)")
    args = p.parse_args(argv)
    grouped = run(args.config, [*args.overrides, "length_group_by=tokens"], args.steps)
    chars = run(args.config, [*args.overrides, "length_group_by=chars"], args.steps)
    plain = run(args.config, [*args.overrides, "length_group_chunk=1"], args.steps)
    print(json.dumps({"device": "cuda" if __import__("torch").cuda.is_available() else "cpu", "steps": args.steps,
                      "grouped_by_tokens": grouped, "grouped_by_chars": chars, "ungrouped": plain,
                      "rows_per_s_ratio_tokens_vs_chars": round(grouped["rows_per_s"] / chars["rows_per_s"], 3),
                      "rows_per_s_ratio_tokens_vs_ungrouped": round(grouped["rows_per_s"] / plain["rows_per_s"], 3)},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
