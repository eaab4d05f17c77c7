"""`python -m jobs.multistep --data-dir D [--scale F] [--seed S]`: the multistep corpus stage (see --help)."""

from __future__ import annotations

import sys

from hobson.corpus.cli import stage_main


def main(argv: list[str] | None = None) -> int:
    return stage_main("multistep", argv)


if __name__ == "__main__":
    sys.exit(main())
