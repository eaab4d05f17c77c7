"""Command lines of the corpus stages (``python -m jobs.<stage>``): argparse, run, report."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hobson.corpus.stages import RUNNERS, run_fetch
from hobson.corpus.sums import DEFAULT_SCALE, DEFAULT_SEED, SUMS_NAME, read_sums, update_committed
from hobson.errors import HobsonError
from hobson.io import count_lines

_DESCRIPTIONS = {
    "build": "Short-task rows (15 computable task families) -> D/build/{train,eval}.jsonl.",
    "multistep": "2-3-hop rows over stated facts -> D/multistep/{train,eval}.jsonl.",
    "generated": "Paraphrased questions -> D/generated/{train,eval}.jsonl plus the paired eval sets "
                 "D/generated/consistency.jsonl and D/generated/flip.jsonl.",
    "adequacy": "Request/response adequacy rows -> D/adequacy/{train,eval}.jsonl.",
    "catchall": 'Rows whose right answer is "none of these" -> D/catchall/{train,eval}.jsonl.',
}


def _report(paths: list[Path]) -> None:
    for p in paths:
        rows = count_lines(p) if p.suffix == ".jsonl" else None
        print(f"{p}" + (f"\t{rows} rows" if rows is not None else ""))


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """Entry point of ``jobs/<stage>.py`` for the generator stages."""
    p = argparse.ArgumentParser(prog=f"python -m jobs.{stage}", description=_DESCRIPTIONS[stage])
    p.add_argument("--data-dir", type=Path,
                   help=f"corpus root D; files go to D/{stage}/ (required unless --write-sums)")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                   help="multiply every family's row count (default 1: thousands of rows; 50-300 gives "
                        "10^5-10^6)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="seed of the generator streams (default 0, the committed default corpus)")
    p.add_argument("--write-sums", action="store_true",
                   help="build the default corpus (seed 0, scale 1) without comparing it to "
                        "data/SHA256SUMS, then rewrite this stage's lines there; run it after an "
                        "intended generator change and commit data/SHA256SUMS")
    args = p.parse_args(argv)
    try:
        if args.write_sums:
            return _write_sums(stage, args)
        if args.data_dir is None:
            p.error("--data-dir is required")
        _report(RUNNERS[stage](args.data_dir, scale=args.scale, seed=args.seed))
    except HobsonError as e:
        print(f"{stage}: error: {e}", file=sys.stderr)
        return 1
    return 0


def _write_sums(stage: str, args: argparse.Namespace) -> int:
    if args.scale != DEFAULT_SCALE or args.seed != DEFAULT_SEED:
        print(f"{stage}: error: --write-sums records the default corpus; drop --scale/--seed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix=f"hobson-{stage}-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        RUNNERS[stage](data_dir, compare_committed=False)
        digests = read_sums(Path(data_dir) / stage / SUMS_NAME)
        path = update_committed(digests, stage)
    for rel in sorted(digests):
        print(f"{digests[rel]}  {rel}")
    print(f"updated {path}")
    return 0


def fetch_main(argv: list[str] | None = None) -> int:
    """Entry point of ``jobs/fetch.py``."""
    p = argparse.ArgumentParser(
        prog="python -m jobs.fetch",
        description="Download the raw sources a config lists into D/raw/<name> (resumable, verified by "
                    "size and sha256) and write D/raw/MANIFEST.json and D/raw/SHA256SUMS.")
    p.add_argument("--data-dir", type=Path, required=True, help="corpus root D; files go to D/raw/")
    p.add_argument("--config", type=Path, default=None,
                   help="fetch config YAML (default: configs/fetch.yaml of this checkout; keys: sources: "
                        "[{name, url, size, sha256, format}])")
    p.add_argument("--retries", type=int, default=5, help="extra attempts per source after a failure (default 5)")
    p.add_argument("--backoff", type=float, default=0.5,
                   help="seconds before the first retry, doubling each time (default 0.5)")
    p.add_argument("--timeout", type=float, default=60.0, help="socket timeout in seconds (default 60)")
    args = p.parse_args(argv)
    try:
        _report(run_fetch(args.data_dir, args.config, retries=args.retries, backoff_s=args.backoff,
                          timeout_s=args.timeout))
    except HobsonError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 1
    return 0
