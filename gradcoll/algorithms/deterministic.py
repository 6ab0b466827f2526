"""Bitwise-reproducible allreduce: every element summed exactly where all its contributions meet.

Floating-point addition is not associative, so the bits of an ordinary
allreduce depend on the algorithm, the chunking and the order of arrival.
This one does not, and it moves the same bytes as the ordinary one:

* Raw contributions travel, never partial sums. Every element is reduced by
  exactly one kernel call that sees all ``n`` contributions of it at once
  (``exact_reduce``).
* That kernel puts the element's contributions on a fixed-point grid set by
  the largest of them (``2**(E-F)``, ``max |x| < 2**E``,
  ``F = min(51, 52 - ceil(log2 n))``), rounds each to an integer once, sums
  the integers exactly in float64 (all below ``2**52``) and rounds the sum
  once to the output dtype. A maximum and an exact sum do not depend on
  order, so the result is a function of the multiset of contributions alone:
  the same bits whatever the algorithm, the chunking, the transport, the
  thread count or the arrival order. The exact rules are in
  ``gradcoll.kernels.exact_reference``.
* Where an element's contributions lie within ``F - 24`` binades of its
  largest (27 at 2 ranks, 25 at 8, 19 at 1,024; almost always for the
  gradients of one parameter), nothing is rounded before the sum and the
  result equals ``float32(float64_sum / n)`` bit for bit.

Every schedule runs it (``gradcoll.algorithms.rows``): each gathers the raw
rows of a piece where the piece is reduced, by its own pattern of messages,
and shares the result as its plain form does. ``ring`` (a direct
reduce-scatter and allgather: the ring's bytes in two steps of latency),
``star``, ``recursive_doubling`` (an allgather of the raw buffers, then
every rank reduces: for small buffers), ``halving_doubling`` (a recursive
halving of the rows), ``tree``, ``two_level`` (the hosts' rows to their
leaders, a direct reduce-scatter between leaders) and ``direct`` (the shared
window, with the same exact kernel) all give the same bits. ``max`` and
``min`` are exact in any order, so they run the schedule's plain form.

Non-finite inputs are found by the ordinary local check and travel as a
planted NaN (``gradcoll.algorithms._guard``); an ``op="sum"`` that overflows the output dtype
is planted at the start of the reduced piece.
See docs/algorithms/deterministic.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ..errors import UsageError
from ..kernels import exact_reduce, exact_reference
from ..transport.base import Transport
from . import tags
from ._common import Options, Workspace, plant
from ._guard import guarded_allreduce
from .registry import schedule
from .ring import SEGMENT_BYTES
from .rows import RowsCall

__all__ = ["deterministic_allreduce", "exact_reduce", "fraction_bits", "ExactRows"]

fraction_bits = exact_reference.fraction_bits

#: The dtypes the exact reduction takes.
EXACT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def deterministic_allreduce(transport: Transport, buf: np.ndarray, *, algorithm: str = "ring", op: str = "mean",
                            check_finite: bool = True, seq: int = 0, timeout: float | None = None,
                            workspace: Workspace | None = None, backend: str | None = None,
                            segment_bytes: int = SEGMENT_BYTES,
                            hosts: Sequence[Hashable] | None = None, **_: object) -> np.ndarray:
    """Allreduce ``buf`` (float32/float64) in place with bit-identical results under any schedule; returns ``buf``.

    ``segment_bytes``: the ring's pieces. ``hosts``: the two-level schedule's
    host of every rank.
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise UsageError("buf must be a writeable C-contiguous numpy array")
    if buf.dtype not in EXACT_DTYPES:
        raise UsageError(f"deterministic allreduce takes float32 or float64, got {buf.dtype}")
    entry = schedule(algorithm)
    if op in ("max", "min"):  # exact in any order: the plain form gives the same bits under every schedule
        kw: dict[str, object] = {"hosts": hosts} if algorithm == "two_level" else {}
        return entry.allreduce(transport, buf, op=op, check_finite=check_finite, seq=seq,  # type: ignore[return-value]
                               timeout=timeout, workspace=workspace, backend=backend, **kw)
    if op not in ("mean", "sum"):
        raise UsageError(f"op must be one of mean, sum, max, min; got {op!r}")
    if entry.rows is None:  # the shared window, with the same exact kernel
        from .direct import direct_exact

        return direct_exact(transport, buf, op=op, check_finite=check_finite, seq=seq, timeout=timeout,
                            backend=backend)
    rows, reducer = entry.rows, ExactRows(float(transport.size) if op == "mean" else 1.0, check_finite, backend)

    def body(coll: object, flat: np.ndarray, opts: Options) -> None:
        rows(coll, RowsCall(flat, reducer, opts.workspace, segment_bytes, hosts))  # type: ignore[arg-type]

    return guarded_allreduce(transport, buf, Options(op, check_finite, seq, timeout, workspace, backend),
                             name=f"deterministic {algorithm} allreduce", algo=algorithm, variant=tags.DETERMINISTIC,
                             body=body)


class ExactRows:
    """The deterministic variant (``gradcoll.algorithms.rows.Rows``): ``n`` rows summed exactly, divided, rounded
    once; with ``check``, an output that overflowed marks ``out``."""

    __slots__ = ("divisor", "check", "backend")

    def __init__(self, divisor: float, check: bool, backend: str | None) -> None:
        self.divisor, self.check, self.backend = divisor, check, backend

    def reduce(self, rows: np.ndarray, out: np.ndarray) -> None:
        if exact_reduce(rows[0], rows[1:], out, self.divisor, self.backend) >= 0 and self.check:
            plant(out)
