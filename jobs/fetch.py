"""`python -m jobs.fetch --data-dir D [--config configs/fetch.yaml]`: download raw sources (see --help)."""

from __future__ import annotations

import sys

from hobson.corpus.cli import fetch_main


def main(argv: list[str] | None = None) -> int:
    return fetch_main(argv)


if __name__ == "__main__":
    sys.exit(main())
