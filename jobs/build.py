"""`python -m jobs.build --data-dir D [--scale F] [--seed S]`: the build corpus stage (see --help)."""

from __future__ import annotations

import sys

from hobson.corpus.cli import stage_main


def main(argv: list[str] | None = None) -> int:
    return stage_main("build", argv)


if __name__ == "__main__":
    sys.exit(main())
