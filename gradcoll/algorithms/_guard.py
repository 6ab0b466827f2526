"""The guarded allreduce frame: the checks that ride on the data instead of a round of their own.

Every allreduce (ring, star, recursive doubling, and the low-precision and
deterministic variants) runs in ``guarded_allreduce``. Over a transport with
lenient tags (``tcp``, ``shm``, ``inproc``; see ``LENIENT_TAG``) it sends no
agreement round before its data. Its guarantees move here:

* **Mismatches.** Every data tag is ``tags.descriptor_tag``: a hash of the
  descriptor (kind, algorithm, op, dtype, count, root, seq, check_finite)
  and of the variant, plus the phase. A rank that called something else
  sends frames with other tags or lengths; the receiving transport hands
  such a frame back as a ``FrameMismatch`` and keeps the link.
* **Non-finite inputs (Jidoka).** With ``check_finite`` each rank scans its
  own input before sending, remembers the first bad element and plants a NaN
  in element 0 (``_common.plant``). Every reduction carries that NaN into
  the result (max/min too, which could otherwise hide an infinity), and the
  reducing kernels plant one where a sum overflows, at a slot the schedule
  declared in ``Coll.marks``. The result is bitwise the same on every rank,
  so every rank finds the same marker in it (``first_marker``) and enters
  the error path together: no rank returns while another halts.
* **The error path** (``gradcoll.algorithms._alarm.fail``), only after
  something went wrong (a mismatch, a timeout, a closed or broken link,
  bytes that break the protocol, a non-finite result): the rank sends its
  64-byte record, with what it saw, to every peer under ``tags.ALARM`` and
  on the group's witness channel (``_witness``), and collects theirs until
  every peer is settled. Every rank then applies the verdict of
  ``gradcoll.algorithms._verdict`` to the same table (``ALARMS``): the root
  cause first (the rank that died, whose bytes broke the protocol, that
  closed its group, that stalled), never the neighbour that noticed it.
* **Hostile lengths.** The frame raises the transport's ``stray_limit`` to
  the size of the call, so a stray frame up to what this collective sends
  is taken in whole, and a longer one is refused unread (ProtocolError
  naming the peer) instead of sizing an allocation.

Transports without lenient tags (``mpi``) run the handshake round of
``gradcoll.algorithms._handshake`` before the data and use the error path only for a
non-finite result, when every stream is clean.

The variants use the frame's seams rather than a copy of it: ``variant``
(folded into the tags), ``flat`` (the array the descriptor names, when the
variant validated the buffer itself), ``prepare`` (a pre-encode that checks
the input itself, instead of the frame's check) and ``find_bad`` (how the
result is read for a marker).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..transport.base import Transport
from . import tags
from ._alarm import fail
from ._common import Coll, Options, as_flat, check_op, plant
from ._handshake import descriptor, handshake, local_status, with_status
from ._verdict import LINK_ERRORS

__all__ = ["guarded_allreduce", "first_marker", "fail", "ERRORS"]

#: Errors that send a collective down the error path.
ERRORS = LINK_ERRORS

Body = Callable[[Coll, np.ndarray, Options], None]
Marker = tuple[int, float] | None


def guarded_allreduce(transport: Transport, buf: np.ndarray, opts: Options, *, name: str, algo: str, body: Body,
                      variant: tuple[int, ...] = tags.PLAIN, flat: np.ndarray | None = None,
                      prepare: Callable[[Coll, np.ndarray], None] | None = None,
                      find_bad: Callable[[Coll, np.ndarray], Marker] | None = None) -> np.ndarray:
    """The frame every allreduce runs in; returns ``buf``.

    Validate (``as_flat``, unless the caller passes its own ``flat``), set
    the descriptor tags (or run the handshake) and the local finite check,
    run ``body(coll, flat, opts)`` on the data path (after ``prepare``, a
    pre-encode that then checks the input instead of the frame), send any
    failure through the error path (``fail``), and halt every rank alike
    when the result carries a marker (``find_bad``, by default
    ``first_marker``).
    """
    if flat is None:
        flat = as_flat(buf, reduce=True)
        check_op(opts.op)
    coll = Coll(transport, name, opts.seq, flat.nbytes, opts.timeout)
    if flat.nbytes > transport.stray_limit:
        transport.stray_limit = flat.nbytes  # frames of this call may arrive as strays (see the module doc)
    status = None if prepare is not None else local_status(flat, opts.check_finite, opts.backend)
    if status is not None:
        plant(flat)  # carried into every rank's result, whatever the op
    coll.status = status
    coll.desc = descriptor("allreduce", algo, opts.op, flat.dtype, flat.size, opts.seq)
    if transport.lenient_tags:
        coll.tag0 = tags.descriptor_tag(coll.desc + (opts.check_finite,), variant)
        coll.pending = {}
    else:
        handshake(coll, with_status(coll.desc, status))
    if coll.size > 1:  # even for 0 elements: the empty frames still carry the descriptor
        if prepare is not None:
            prepare(coll, flat)
        try:
            body(coll, flat, opts)
        except ERRORS as exc:
            fail(coll, exc)
    if opts.check_finite and flat.size:
        bad = (find_bad or first_marker)(coll, flat)
        if bad is not None:
            fail(coll, None, bad)
    return buf


def first_marker(coll: Coll, result: np.ndarray, values: np.ndarray | None = None,
                 bad: Callable[[int], bool] | None = None) -> Marker:
    """The one sentinel check: the first slot of ``coll.marks`` where ``result`` holds a marker.

    Returns ``(index, value)`` (``value`` read from ``values``, default
    ``result``) or None. ``bad`` tells a marker for arrays that are not
    floats (the low-precision wire bits); by default NaN or Inf.
    """
    for a in coll.marks:
        if bad(int(result[a])) if bad is not None else not math.isfinite(result[a]):
            return a, float((result if values is None else values)[a])
    return None


#: The dtypes of the compiled paths that run outside the guard (``_planned.run_plan``).
LEAN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
