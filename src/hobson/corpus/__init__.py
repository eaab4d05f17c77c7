"""The decider corpus: row schema, deterministic generators, and the corpus stages.

Public API::

    from hobson.corpus import read_rows, verify_corpus, EXPECTED_ROWS
    from hobson.corpus.stages import run_build, run_fetch, run_multistep, run_generated, \
        run_adequacy, run_catchall
"""

from hobson.corpus.schema import iter_rows, read_rows, validate_row
from hobson.corpus.stages import EXPECTED_ROWS, STAGE_OUTPUTS, STAGES
from hobson.corpus.sums import verify_corpus

__all__ = ["EXPECTED_ROWS", "STAGES", "STAGE_OUTPUTS", "iter_rows", "read_rows", "validate_row", "verify_corpus"]
