"""`python -m jobs.catchall --data-dir D [--scale F] [--seed S]`: the catchall corpus stage (see --help)."""

from __future__ import annotations

import sys

from hobson.corpus.cli import stage_main


def main(argv: list[str] | None = None) -> int:
    return stage_main("catchall", argv)


if __name__ == "__main__":
    sys.exit(main())
