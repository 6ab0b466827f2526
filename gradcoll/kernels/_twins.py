"""The serial and the threaded compilation of one Numba kernel body (``numba_cpu``, ``numba_lowp``)."""

from __future__ import annotations

import types
from typing import Any

from numba import njit


def twins(body: Any) -> tuple[Any, Any]:
    """The serial and the threaded compilation of one body, each cached on disk under its own name.

    Numba's disk cache files an entry under the function's qualified name, line and signature, not its
    options (numba issue 6845): the same function compiled twice, serial and ``parallel=True``, shares one
    entry, and whichever compilation was cached first is what both dispatchers load in every later process.
    The threaded kernels then ran on one thread (2x slower at 1e7 elements) or the serial ones started
    threads, depending on which a process compiled first. The threaded one compiles a copy of the function
    named ``<name>_parallel``.
    """
    par = types.FunctionType(body.__code__, body.__globals__, f"{body.__name__}_parallel", body.__defaults__,
                             body.__closure__)
    par.__qualname__ = f"{body.__qualname__}_parallel"
    return (njit(cache=True, fastmath=False, nogil=True)(body),
            njit(cache=True, fastmath=False, nogil=True, parallel=True)(par))
