"""The serial and the threaded compilation of one Numba kernel body (``numba_cpu``, ``numba_lowp``), and the
blocks a kernel's ``prange`` runs over (``split``)."""

from __future__ import annotations

import types
from typing import Any

import numba
from numba import njit

#: About this many elements per block; each block ORs its own finite flag.
BLOCK = 16384
#: The threads a ``prange`` splits over by default (the cores, or ``NUMBA_NUM_THREADS``), read at import.
THREADS = max(1, int(numba.config.NUMBA_NUM_THREADS))


@njit(cache=True, nogil=True)
def split(m):
    """(blocks, elements per block) for ``m`` elements: a kernel's ``prange`` runs over the blocks.

    The number of blocks is a multiple of ``THREADS`` and the blocks are of one size (a multiple of 16
    elements, 64 bytes of float32: no two threads write one cache line), so every thread gets the same
    share. Blocks of exactly ``BLOCK`` elements, the last one short, gave one thread 4 blocks and the other
    3 at 1e5 elements on 2 threads (65,536 elements against 34,464), so the first thread set the pace, well
    behind an even split (docs/kernels.md). ``THREADS`` is a constant in the compiled (and
    cached) code, not the thread count of the moment: it sets only how evenly the work is shared, never a
    result, and a process that lowers the count with ``numba.set_num_threads`` gets a split that may be
    uneven. Asking for the count inside the kernel would make it uncacheable (``numba.get_num_threads``
    reads a ctypes pointer), and asking in Python costs a small call's share. The last blocks may be short or
    empty (all of them when ``m`` is 0)."""
    nb = max(THREADS, ((m + BLOCK - 1) // BLOCK + THREADS - 1) // THREADS * THREADS)
    return nb, ((m + nb - 1) // nb + 15) // 16 * 16


def twins(body: Any) -> tuple[Any, Any]:
    """The serial and the threaded compilation of one body, each cached on disk under its own name.

    Numba's disk cache files an entry under the function's qualified name, line and signature, not its
    options (numba issue 6845): the same function compiled twice, serial and ``parallel=True``, shares one
    entry, and whichever compilation was cached first is what both dispatchers load in every later process.
    The threaded kernels then ran on one thread (at a fraction of their speed) or the serial ones started
    threads, depending on which a process compiled first. The threaded one compiles a copy of the function
    named ``<name>_parallel``.
    """
    par = types.FunctionType(body.__code__, body.__globals__, f"{body.__name__}_parallel", body.__defaults__,
                             body.__closure__)
    par.__qualname__ = f"{body.__qualname__}_parallel"
    return (njit(cache=True, fastmath=False, nogil=True)(body),
            njit(cache=True, fastmath=False, nogil=True, parallel=True)(par))
