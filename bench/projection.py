"""``recipe all --ngpu N``, projected from one GPU's stage throughputs (a projection, not a run).

    python bench/recipe_gpu.py all --device cuda --json one_gpu.json      # measure, one GPU
    python bench/projection.py one_gpu.json --gpus 8 [--scales 1,100,1000] [--json out.json]

Inputs, all from the measured JSON except the two assumptions named on the command line:
- teacher: the batched labeller's rows/s (part ``label``, the Qwen3-4B-shaped teacher);
- parent and final training: the recipe's rows/s (part ``train``, the Qwen3.5-2B-shaped torso)
  and its trainable parameter count;
- replay: the decider's labelling rows/s (part ``replay``).

How N GPUs divide the work (the recipe's contracts, docs/ARCHITECTURE.md):
- the teacher and replay arrays split the rows N ways, so each takes ``rows / (N * rows_per_s)``;
- DDP keeps one GPU's step: ``micro_batch_size x grad_accum`` rows per step at any world size,
  the micro-batches dealt to the ranks. A step therefore takes ``ceil(grad_accum / N)``
  micro-batch times plus one all-reduce of the trainable gradients (fp32, ring:
  ``2 (N-1)/N x bytes / bandwidth``, not overlapped with the backward: an upper bound). With the
  shipped ``grad_accum: 2`` only two of eight GPUs have work in a step; the table also gives the
  time with ``grad_accum`` raised to N (the same micro-batches, N times the rows per step);
- merges and distill are file work (seconds at these sizes) and calibration/evaluation run the
  replay forward over the held-out rows only: neither is projected.

Rows: the measured corpus times each ``--scales`` factor (``corpus.scale`` in configs/recipe.yaml:
1 is the shipped corpus, 100-1000 give 10^5-10^6 rows); epochs from the two training configs.
The anchor (strands-decider, 8xH100, docs in ../shared/DESIGN.md): teacher 179 s, parent 26 min,
replay 133 s, train 28 min, all 1 h 10 min.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml
from common import print_table, write_json

REPO = Path(__file__).resolve().parents[1]
ANCHOR_S = {"teacher": 179.0, "parent": 26 * 60.0, "replay": 133.0, "final": 28 * 60.0, "all": 70 * 60.0}


def epochs_and_batch(config: Path) -> tuple[int, int, int]:
    """(epochs, micro_batch_size, grad_accum) of a training config."""
    cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
    return int(cfg["epochs"]), int(cfg["micro_batch_size"]), int(cfg["grad_accum"])


def training_seconds(rows: int, epochs: int, micro: int, accum: int, rows_per_s: float, gpus: int,
                     grad_bytes: float, bandwidth_gbs: float) -> dict[str, float]:
    """One training stage at ``gpus`` ranks: steps x (micro-batch times on the busiest rank + all-reduce)."""
    steps = math.ceil(rows * epochs / (micro * accum))
    micro_s = micro / rows_per_s
    allreduce_s = 2 * (gpus - 1) / gpus * grad_bytes / (bandwidth_gbs * 1e9) if gpus > 1 else 0.0
    step_s = math.ceil(accum / gpus) * micro_s + allreduce_s
    return {"steps": steps, "step_s": step_s, "allreduce_s": allreduce_s, "seconds": steps * step_s}


def project(fig: dict[str, Any], *, gpus: int, scale: float, parent_cfg: Path, final_cfg: Path,
            bandwidth_gbs: float, accum: int | None = None) -> dict[str, Any]:
    """Seconds per stage for ``scale`` x the measured corpus on ``gpus`` GPUs; ``accum`` overrides grad_accum."""
    rows = round(fig["label"]["rows"] * scale)
    train = fig["train"]
    grad_bytes = 4.0 * train["torso"]["trainable_params"]
    out: dict[str, Any] = {"gpus": gpus, "scale": scale, "rows": rows, "grad_bytes": grad_bytes}
    out["teacher"] = rows / (gpus * fig["label"]["batched"]["rows_per_s"])
    out["replay"] = rows / (gpus * fig["replay"]["rows_per_s"])
    for stage, cfg in (("parent", parent_cfg), ("final", final_cfg)):
        epochs, micro, ga = epochs_and_batch(cfg)
        t = training_seconds(rows, epochs, micro, accum or ga, train["rows_per_s"], gpus, grad_bytes, bandwidth_gbs)
        out[stage] = t["seconds"]
        out[f"{stage}_detail"] = {"epochs": epochs, "micro_batch_size": micro, "grad_accum": accum or ga, **t}
    out["all"] = out["teacher"] + out["parent"] + out["replay"] + out["final"]
    return out


def hms(s: float) -> str:
    s = round(s)
    return f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else f"{s // 60} min {s % 60:02d} s"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("measured", help="the JSON of `bench/recipe_gpu.py all` (parts label, train, replay)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--scales", default="1,100,1000", help="corpus scale factors (default 1,100,1000)")
    p.add_argument("--nvlink-gbs", type=float, default=450.0,
                   help="all-reduce bandwidth per GPU in GB/s: an assumption, not measured here (default 450: "
                        "NVLink 4's 900 GB/s both ways, halved)")
    p.add_argument("--parent-config", default=str(REPO / "configs" / "train-parent.yaml"))
    p.add_argument("--final-config", default=str(REPO / "configs" / "train.yaml"))
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fig = json.loads(Path(args.measured).read_text(encoding="utf-8"))
    missing = [part for part in ("label", "train", "replay") if part not in fig or "error" in fig[part]]
    if missing:
        print(f"{args.measured}: no figures for {', '.join(missing)}; run bench/recipe_gpu.py all first",
              file=sys.stderr)
        return 2
    results = []
    for scale in (float(x) for x in args.scales.split(",")):
        for accum in (None, args.gpus):
            r = project(fig, gpus=args.gpus, scale=scale, parent_cfg=Path(args.parent_config),
                        final_cfg=Path(args.final_config), bandwidth_gbs=args.nvlink_gbs, accum=accum)
            results.append(r)
            label = "as configured" if accum is None else f"grad_accum {accum}"
            print_table(f"PROJECTION: recipe all --ngpu {args.gpus}, {r['rows']:,} rows (scale {scale:g}), "
                        f"training {label}", [
                *((stage, f"{hms(r[stage])} (anchor {hms(ANCHOR_S[stage])})")
                  for stage in ("teacher", "parent", "replay", "final")),
                ("training step (busiest rank + all-reduce)",
                 f"{r['parent_detail']['step_s'] * 1e3:.1f} ms, of which all-reduce "
                 f"{r['parent_detail']['allreduce_s'] * 1e3:.2f} ms"),
                ("all (stages above, back to back)", f"{hms(r['all'])} (anchor 1 h 10 min on 8xH100)")])
    if args.json:
        write_json(args.json, {"bench": "projection", "projection": True, "measured": args.measured,
                               "measured_environment": fig.get("environment"), "nvlink_gbs_assumed": args.nvlink_gbs,
                               "anchor_s": ANCHOR_S, "results": results, "command": sys.argv})
    return 0


if __name__ == "__main__":
    sys.exit(main())
