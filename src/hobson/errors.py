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
