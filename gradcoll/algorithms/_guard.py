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
* **The error path** (``fail``), only after something went wrong (a
  mismatch, a timeout, a closed link, a non-finite result): the rank sends
  its 64-byte handshake record, with what it saw, to every peer under
  ``tags.ALARM`` and collects theirs until a grace deadline, consuming the
  stray data frames still queued before them. A peer still waiting for data
  from it is woken by the alarm (its receive fails with the alarm frame).
  Every rank then applies the verdict of ``gradcoll.algorithms._verdict`` to
  the same table (``ALARMS``): a rank that never sent a record did not
  arrive, records that differ are a CollectiveMismatch naming rank 0's call
  and the first different one, NONFINITE statuses name the lowest culprit.

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
from typing import NoReturn

import numpy as np

from ..errors import CollectiveTimeout, ProtocolError, TransportBroken, TransportClosed, TransportError
from ..transport.base import Deadline, Request, Transport
from ..transport.frame import FrameMismatch
from . import tags
from ._common import Coll, Options, as_flat, check_op, plant
from ._handshake import RECORD_SIZE, Record, absent, descriptor, handshake, local_status, pack, unpack, with_status
from ._verdict import ALARMS, LINK_ERRORS, OK, PROTOCOL, TIMEOUT, status_of, verdict

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


def _experience(exc: BaseException) -> tuple[tuple[int, int, float], int]:
    """(status, peer) for this rank's record after ``exc``: what it met, on the link to whom."""
    if isinstance(exc, FrameMismatch):  # a frame of another call, or an alarm that woke it (its links are fine)
        return (OK if exc.tag == tags.ALARM else PROTOCOL, -1, 0.0), exc.peer
    status = (status_of(exc), -1, 0.0)
    if isinstance(exc, CollectiveTimeout):
        return status, exc.missing[0] if exc.missing else -1
    if isinstance(exc, TransportError) and isinstance(exc.peer, int):
        return status, exc.peer
    return status, -1


def fail(coll: Coll, exc: BaseException | None, bad: tuple[int, float] | None = None) -> NoReturn:
    """The error path: exchange records with every peer, then raise the verdict every rank reaches.

    ``exc`` is what went wrong on the data path (None when the data phase
    finished but the result is non-finite; ``bad`` then gives the first bad
    element and its value).
    """
    t, n, me = coll.t, coll.size, coll.rank
    if exc is not None and (coll.pending is None or t.closed):
        raise exc  # no lenient tags (data errors are reported as they are), or nothing left to talk over
    own = with_status(coll.desc, coll.status) if exc is None else with_status(coll.desc, *_experience(exc))
    table: list[Record | None] = [None] * n
    table[me] = own
    if isinstance(exc, FrameMismatch) and exc.tag == tags.ALARM:
        table[exc.peer] = _parse(exc.payload)
    if n > 1:
        _exchange(coll, table, collect=not isinstance(exc, (TransportClosed, TransportBroken)))
    verdict(coll, [s if s is not None else absent(TIMEOUT) for s in table], ALARMS, own=exc, marker=bad)
    raise AssertionError("the verdict of a failed collective always raises")  # pragma: no cover


def _parse(payload: bytes) -> Record:
    if len(payload) != RECORD_SIZE:
        return absent(PROTOCOL)
    try:
        return unpack(payload, 1)[0]
    except ProtocolError:
        return absent(PROTOCOL)


def _exchange(coll: Coll, table: list[Record | None], collect: bool) -> None:
    """Send this rank's record to every peer; with ``collect``, gather theirs into ``table`` until the grace."""
    t, me = coll.t, coll.rank
    grace = Deadline(None if coll.timeout is None else min(5.0, max(1.0, coll.timeout)))
    mine = pack([table[me]])  # type: ignore[list-item]
    peers = [p for p in range(coll.size) if p != me]
    sends = []
    for p in peers:
        try:
            sends.append(t.isend(p, mine, tags.ALARM))
        except ERRORS as exc:
            if table[p] is None:
                table[p] = absent(status_of(exc))
    if collect:
        # Receives the data phase left behind: unstarted ones are withdrawn, one
        # already reading a frame finishes it first (that frame may be p's alarm).
        leftovers = list((coll.pending or {}).items())
        for req, _ in leftovers:
            req.cancel()
        posted = {p: _post(t, p, table) for p in peers if table[p] is None}  # all at once: none waits for another
        for req, p in leftovers:  # only an alarm counts: their own failures are this rank's story
            try:
                req.wait(grace.remaining())
            except FrameMismatch as exc:
                if exc.tag == tags.ALARM and table[p] is None:
                    table[p] = _parse(exc.payload)
            except ERRORS:
                pass
        for p, (alarm, buf) in posted.items():
            while table[p] is None and alarm is not None:
                if _take(alarm, p, table, grace) and table[p] is None:
                    table[p] = _parse(bytes(buf))
                elif table[p] is None:  # a stray data frame went by: wait for the next one
                    alarm, buf = _post(t, p, table)
            if alarm is not None:
                alarm.cancel()
    if coll.pending:
        coll.pending.clear()
    for req in sends:
        try:
            req.wait(grace.remaining())
        except ERRORS:
            pass


def _post(t: Transport, p: int, table: list[Record | None]) -> tuple[Request | None, bytearray]:
    buf = bytearray(RECORD_SIZE)
    try:
        return t.irecv(p, buf, tags.ALARM), buf
    except ERRORS as exc:
        table[p] = absent(status_of(exc))
        return None, buf


def _take(req: Request, p: int, table: list[Record | None], grace: Deadline) -> bool:
    """Wait for a receive from ``p``; note an alarm or a failure in ``table``; True if it completed cleanly."""
    try:
        req.wait(grace.remaining())
        return True
    except FrameMismatch as exc:
        if exc.tag == tags.ALARM and table[p] is None:
            table[p] = _parse(exc.payload)
    except ERRORS as exc:
        if table[p] is None:
            table[p] = absent(status_of(exc))
    return False
