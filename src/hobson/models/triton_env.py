"""Whether Triton is here: the decode kernels (skinny products, row norms, decode attention) run
only with it, and CPU torch does not bring it. A leaf module, so those kernels and the layers that
call them share one answer without importing each other."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
