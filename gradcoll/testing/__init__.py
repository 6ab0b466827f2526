"""Test helpers, above all ``check_transport``: the suite every transport passes.

Each check is a small per-rank program ``program(transport, ctx)``. The same
programs run with ranks as threads (``run_check`` over a ``make_group``
factory, e.g. ``threaded_group`` or the in-process transport's), or one
rank per process (``run_spmd``, e.g. under ``mpirun``). Process checks
(``PROCESS_CHECKS``) kill a real peer process and need the transport's
``create`` function; they bootstrap through a [`FileStore`][gradcoll.store.FileStore].

The suite covers ordering, tags, zero-length and large messages, full-duplex
``sendrecv`` (pair and ring), tag/length mismatches, timeouts, orderly close
by the peer and locally, invalid peers and buffers, withdrawing requests
(``cancel``), lenient tags, wait accounting (``note_wait``) and dead peers,
and a tier for each optional capability the transport declares
(``capability_checks``: compiled ``rounds``, the shared window).
Transports whose ranks share memory also pass the window checks
(``window_checks``: ``check_window``, ``run_window_check``): layout,
publish-then-read, descriptors, timeouts naming the late ranks, waiting
without a core, closes, alarms, and a peer killed while others wait.

Modules: ``checks`` (the per-rank programs), ``conformance`` (running
them), ``runners`` (ranks as threads: ``run_ranks``, ``gather_ranks``,
``threaded_group``).
"""

from __future__ import annotations

from .capability_checks import CAPABILITY_CHECKS, CHECKS
from .checks import LARGE as LARGE
from .conformance import PROCESS_CHECKS, check_transport, run_check, run_spmd
from .runners import gather_ranks, run_ranks, threaded_group
from .window_checks import WINDOW_CHECKS, check_window, run_window_check, run_window_spmd

__all__ = [
    "threaded_group",
    "run_ranks",
    "gather_ranks",
    "check_transport",
    "run_check",
    "run_spmd",
    "CHECKS",
    "CAPABILITY_CHECKS",
    "PROCESS_CHECKS",
    "WINDOW_CHECKS",
    "check_window",
    "run_window_check",
    "run_window_spmd",
]
