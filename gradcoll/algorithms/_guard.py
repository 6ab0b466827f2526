"""The checks that ride on the data instead of a round of their own.

Over a transport with lenient tags (``tcp``, ``shm``, ``inproc``; see
``LENIENT_TAG``) an allreduce sends no
agreement round before its data. Its guarantees move here:

* **Mismatches.** Every data tag is ``LENIENT_TAG`` plus a hash of the
  descriptor (kind, algorithm, op, dtype, count, root, seq, check_finite)
  plus the phase. A rank that called something else sends frames with other
  tags or lengths; the receiving transport hands such a frame back as a
  ``FrameMismatch`` and keeps the link.
* **Non-finite inputs (Jidoka).** With ``check_finite`` each rank scans its
  own input before sending, remembers the first bad element and plants a NaN
  in element 0. Every reduction carries that NaN into the result (max/min
  too, which could otherwise hide an infinity), and the reducing kernels
  plant one where a sum overflows. The result is bitwise the same on every
  rank, so every rank sees the same verdict in it and enters the error path
  together: no rank returns while another halts.
* **The error path** (``fail``), only after something went wrong (a
  mismatch, a timeout, a closed link, a non-finite result): the rank sends
  its 64-byte handshake record, with what it saw, to every peer under
  ``ALARM_TAG`` and collects theirs until a grace deadline, consuming the
  stray data frames still queued before them. A peer still waiting for data
  from it is woken by the alarm (its receive fails with the alarm frame).
  Every rank then applies ``_verdict`` to the same table: a rank that
  never sent a record did not arrive (CollectiveTimeout naming it), records
  that differ are a CollectiveMismatch naming rank 0's call and the first
  different one, NONFINITE statuses name the lowest culprit.

Transports without lenient tags (``mpi``) run the handshake round of
``gradcoll.algorithms._handshake`` before the data and use the error path only for a
non-finite result, when every stream is clean.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from ..errors import CollectiveMismatch, CollectiveTimeout, ProtocolError, TransportBroken, TransportClosed
from ..transport.base import Deadline, Request, Transport
from ..transport.frame import LENIENT_TAG, FrameMismatch
from ._common import Coll, as_flat, check_op
from ._handshake import (
    ALGOS,
    BROKEN,
    CLOSED,
    KINDS,
    NONFINITE,
    OK,
    OP_CODES,
    PROTOCOL,
    RECORD_SIZE,
    TIMEOUT,
    Record,
    _absent,
    _pack,
    _unpack,
    handshake,
    local_status,
    raise_nonfinite,
)

__all__ = ["ALARM_TAG", "begin", "fail", "ERRORS"]

#: The tag of an error-path record; above every data tag.
ALARM_TAG = 0x7FFFFFFE
_HASH_MASK = 0x3FFFFF00  # tag0 = LENIENT_TAG | hash bits; phases use the low byte

#: Errors that send a collective down the error path.
ERRORS = (CollectiveTimeout, TransportClosed, TransportBroken, CollectiveMismatch, ProtocolError)

_KIND = {k: i for i, k in enumerate(KINDS)}
_ALGO = {a: i for i, a in enumerate(ALGOS)}
_OP = {o: i for i, o in enumerate(OP_CODES)}


def begin(coll: Coll, kind: str, algo: str, op: str | None, flat: np.ndarray, check: bool,
          backend: str | None = None, root: int = -1) -> None:
    """Set up ``coll`` before any data moves: the descriptor tags and the local finite check."""
    status = local_status(flat, check, backend)
    if status is not None:
        flat[0] = np.nan  # carried into every rank's result, whatever the op
    dt = flat.dtype
    coll.desc = (_KIND[kind], _ALGO[algo], _OP[op or "-"], ord(dt.char), dt.itemsize, root, flat.size, coll.seq)
    coll.status = status
    if coll.t.lenient_tags:
        tag0 = LENIENT_TAG | (hash(coll.desc + (check,)) & _HASH_MASK)  # ints only: the same in every process
        coll.tag0 = tag0
        coll.pending = {}
    else:
        handshake(coll, _record(coll, status))


def _record(coll: Coll, status: tuple[int, int, float] | None, peer: int = -1) -> Record:
    code, index, value = status or (OK, -1, 0.0)
    return Record._make((*coll.desc, code, peer, index, value, 1))


def _experience(exc: BaseException) -> tuple[tuple[int, int, float], int]:
    """(status, peer) for this rank's record after ``exc``."""
    if isinstance(exc, FrameMismatch):
        return (OK if exc.tag == ALARM_TAG else PROTOCOL, -1, 0.0), exc.peer
    if isinstance(exc, CollectiveTimeout):
        return (TIMEOUT, -1, 0.0), exc.missing[0] if exc.missing else -1
    peer = getattr(exc, "peer", None)
    for cls, code in ((TransportClosed, CLOSED), (TransportBroken, BROKEN)):
        if isinstance(exc, cls):
            return (code, -1, 0.0), peer if isinstance(peer, int) else -1
    return (PROTOCOL, -1, 0.0), -1


def fail(coll: Coll, exc: BaseException | None, bad: tuple[int, float] | None = None) -> NoReturn:
    """The error path: exchange records with every peer, then raise the verdict every rank reaches.

    ``exc`` is what went wrong on the data path (None when the data phase
    finished but the result is non-finite; ``bad`` then gives the first bad
    element and its value).
    """
    t, n, me = coll.t, coll.size, coll.rank
    if exc is not None and (coll.pending is None or t.closed):
        raise exc  # no lenient tags (data errors are reported as they are), or nothing left to talk over
    if exc is None:
        own = _record(coll, coll.status)
    else:
        status, peer = _experience(exc)
        own = _record(coll, status, peer)
    table: list[Record | None] = [None] * n
    table[me] = own
    if isinstance(exc, FrameMismatch) and exc.tag == ALARM_TAG:
        table[exc.peer] = _parse(exc.payload)
    if n > 1:
        _exchange(coll, table, collect=not isinstance(exc, (TransportClosed, TransportBroken)))
    _verdict(coll, [s if s is not None else _absent(TIMEOUT) for s in table], exc, bad)


def _parse(payload: bytes) -> Record:
    if len(payload) != RECORD_SIZE:
        return _absent(PROTOCOL)
    try:
        return _unpack(payload, 1)[0]
    except ProtocolError:
        return _absent(PROTOCOL)


def _exchange(coll: Coll, table: list[Record | None], collect: bool) -> None:
    """Send this rank's record to every peer; with ``collect``, gather theirs into ``table`` until the grace."""
    t, me = coll.t, coll.rank
    grace = Deadline(None if coll.timeout is None else min(5.0, max(1.0, coll.timeout)))
    mine = _pack([table[me]])  # type: ignore[list-item]
    peers = [p for p in range(coll.size) if p != me]
    sends = []
    for p in peers:
        try:
            sends.append(t.isend(p, mine, ALARM_TAG))
        except ERRORS as exc:
            if table[p] is None:
                table[p] = _absent(_link_status(exc))
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
                if exc.tag == ALARM_TAG and table[p] is None:
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
        return t.irecv(p, buf, ALARM_TAG), buf
    except ERRORS as exc:
        table[p] = _absent(_link_status(exc))
        return None, buf


def _take(req: Request, p: int, table: list[Record | None], grace: Deadline) -> bool:
    """Wait for a receive from ``p``; note an alarm or a failure in ``table``; True if it completed cleanly."""
    try:
        req.wait(grace.remaining())
        return True
    except FrameMismatch as exc:
        if exc.tag == ALARM_TAG and table[p] is None:
            table[p] = _parse(exc.payload)
    except ERRORS as exc:
        if table[p] is None:
            table[p] = _absent(_link_status(exc))
    return False


def _link_status(exc: BaseException) -> int:
    if isinstance(exc, CollectiveTimeout):
        return TIMEOUT
    if isinstance(exc, TransportClosed):
        return CLOSED
    if isinstance(exc, TransportBroken):
        return BROKEN
    return PROTOCOL


def _verdict(coll: Coll, table: list[Record], exc: BaseException | None, bad: tuple[int, float] | None) -> NoReturn:
    """Raise the error the table implies; every rank with the same table raises the same."""
    me, where = coll.rank, coll.where()
    if isinstance(exc, (TransportClosed, TransportBroken)):
        raise exc  # this rank saw the link go itself: its own words, with the step
    for code, cls, what in ((CLOSED, TransportClosed, "closed the link"), (BROKEN, TransportBroken, "lost the link")):
        for p, s in enumerate(table):
            if s.status == code and (not s.present or s.peer >= 0):
                bad_peer, seen = (p, "") if not s.present else (s.peer, f" (seen by rank {p})")
                raise cls(f"rank {me}: peer {bad_peer} {what} during {where}{seen}", rank=me, peer=bad_peer)
    missing = [p for p, s in enumerate(table) if not s.present]
    if missing:
        who = ", ".join(map(str, missing))
        raise coll.timeout_error(missing, f"rank(s) {who} did not arrive (no data and no alarm from them)")
    ref = table[0]
    for p, s in enumerate(table):
        if s.desc() != ref.desc():
            raise CollectiveMismatch(
                f"rank {me}: collective mismatch: rank 0 called {ref.describe()} but rank {p} called {s.describe()}"
            )
    if exc is None:
        for p, s in enumerate(table):
            if s.status == NONFINITE:
                raise_nonfinite(coll, p, s.index, s.value)
        index, value = bad or (-1, float("nan"))
        raise_nonfinite(coll, None, index, value)
    stalled = sorted({s.peer for s in table if s.status == TIMEOUT and s.peer >= 0})
    if stalled:
        seen = ", ".join(str(p) for p, s in enumerate(table) if s.status == TIMEOUT)
        raise coll.timeout_error(stalled, f"peer(s) {', '.join(map(str, stalled))} stopped responding "
                                          f"(seen by rank(s) {seen})")
    odd = [p for p, s in enumerate(table) if s.status == PROTOCOL]
    if odd:
        raise CollectiveMismatch(
            f"rank {me}: during {where}: rank {odd[0]} received a frame of another collective although every rank "
            f"called {ref.describe()} (do check_finite or segment_bytes differ between ranks?)"
        )
    assert exc is not None  # exc is None only for a non-finite result, handled above
    raise exc


def first_planted(coll: Coll, flat: np.ndarray) -> tuple[int, float] | None:
    """Element 0 when it holds NaN/Inf: where a planted input marker or an overflow marker lands."""
    return None if math.isfinite(flat[0]) else (0, float(flat[0]))


def guarded_allreduce(
    transport: Transport,
    buf: np.ndarray,
    *,
    name: str,
    algo: str,
    op: str,
    check_finite: bool,
    seq: int,
    timeout: float | None,
    backend: str | None,
    body: Callable[[Coll, np.ndarray], None],
    find_bad: Callable[[Coll, np.ndarray], tuple[int, float] | None] = first_planted,
) -> np.ndarray:
    """The frame every allreduce algorithm runs in: validate, set up the descriptor and the
    local finite check (``begin``), run ``body(coll, flat)`` on the data path, send any
    failure through the shared error path (``fail``), and halt every rank alike when the
    result carries a non-finite marker (``find_bad``). Returns ``buf``."""
    flat = as_flat(buf, reduce=True)
    check_op(op)
    coll = Coll(transport, name, seq, flat.nbytes, timeout)
    begin(coll, "allreduce", algo, op, flat, check_finite, backend)
    if coll.size > 1:  # even for 0 elements: the empty frames still carry the descriptor
        try:
            body(coll, flat)
        except ERRORS as exc:
            fail(coll, exc)
    if check_finite and flat.size:
        bad = find_bad(coll, flat)
        if bad is not None:
            fail(coll, None, bad)
    return buf
