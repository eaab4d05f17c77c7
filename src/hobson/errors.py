"""Error types. Each message names the evidence (file:line, key, job id) and, where known, the fix."""


class HobsonError(Exception):
    """Base class: the CLI prints these without a traceback and exits non-zero."""


class DataError(HobsonError):
    """Malformed input data; the message starts with ``file:line:``."""


class ConfigError(HobsonError):
    """A config file or flag is invalid; the message lists every problem at once."""


class DigestMismatch(HobsonError):
    """A file's bytes differ from the digest recorded for it."""


class StageError(HobsonError):
    """A stage failed or cannot run (e.g. a missing input)."""


def internal_error(exc: BaseException, prog: str) -> int:
    """One clear message for a bug (an exception that is not a :class:`HobsonError`): what failed,
    and the file its traceback went to; ``HOBSON_DEBUG=1`` re-raises instead (full traceback).
    Returns the exit code, 70 (EX_SOFTWARE)."""
    import errno
    import os
    import sys
    import tempfile
    import time
    import traceback

    if os.environ.get("HOBSON_DEBUG") == "1":
        raise exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk, not a bug
        # every hobson writer names its file (DiskFull); this is a write elsewhere, so name where we were
        where = exc.filename or f"a write under {os.getcwd()}"
        print(f"{prog}: error: {where}: no space left on the device; free space, then resume "
              "(a checkpoint or publication being written was not kept half-written)", file=sys.stderr)
        return 1
    fd, path = tempfile.mkstemp(prefix=f"hobson-internal-error-{time.strftime('%Y%m%dT%H%M%S')}-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"{prog} {' '.join(sys.argv[1:])}\n\n")
        traceback.print_exception(exc, file=f)
    print(f"{prog}: internal error: {type(exc).__name__}: {exc}\n"
          f"  this is a bug in hobson, not in your input; the traceback is in {path}\n"
          f"  (HOBSON_DEBUG=1 prints it here instead); please report it with that file", file=sys.stderr)
    return 70


class DiskFull(StageError):
    """A write ran out of space; the message names the path, the bytes needed and those free."""
