"""The error path of the guarded allreduce: tell every peer what this rank saw, learn what they saw, raise the verdict.

Only after something went wrong (a mismatch, a timeout, a closed or broken
link, bytes that break the protocol, a non-finite result) a rank runs
``fail``. It publishes its 64-byte record (``_handshake.Record``: its call,
and the status it met on the link to which peer) on the witness channel
(``_witness``) and sends it to every peer under ``tags.ALARM`` over the
transport: a peer still waiting for data from it is woken by the alarm
(its receive fails with the alarm frame). Then it collects the others'
records from both, consuming the stray data frames still queued before
them, until every peer is *settled*: its record came, or it is dead (a link
to it broke from outside and it sent nothing), or (with no witness channel)
its link is gone. A rank that stalled settles nobody: the others wait for
it until the grace deadline, ``GRACE_END`` past their own call's
timeout (so a stall costs the timeout plus at most that), or ``GRACE_ROOT``
once a root cause is in hand. Every rank then applies the verdict of
``gradcoll.algorithms._verdict`` to the table (``ALARMS``).

Waiting for the records is what makes the verdicts agree: the table every
rank reads holds every live rank's record, and the root cause (who died,
who stalled, whose bytes were wrong) is in one of them.
"""

from __future__ import annotations

import time
from typing import NoReturn

from ..errors import CollectiveTimeout, ProtocolError, TransportClosed, TransportError
from ..transport.base import Request
from ..transport.frame import FrameMismatch
from . import _witness, tags
from ._common import Coll, closing
from ._handshake import RECORD_SIZE, Record, absent, pack, unpack, with_status
from ._verdict import ALARMS, BROKEN, LINK_ERRORS, MALFORMED, OK, PROTOCOL, TIMEOUT, is_root, status_of, verdict

__all__ = ["fail", "experience", "own_record", "GRACE_END", "GRACE_ROOT", "GRACE_MIN", "GRACE_MAX", "CONFIRM_S"]

#: Seconds past the collective's own deadline a rank waits for records still missing (a stall costs this).
GRACE_END = 0.4
#: Seconds a rank waits for records still missing once some record names a root cause.
GRACE_ROOT = 0.4
#: The error path waits at least this long for a missing record, and never longer than GRACE_MAX.
GRACE_MIN = 0.5
GRACE_MAX = 5.0
#: Seconds a rank waits for the record of a peer whose link broke before it counts it dead: a live rank
#: that dropped its links after an error of its own publishes its record at once (over tcp an end of
#: stream does not tell a dead process from one that closed its socket).
CONFIRM_S = 0.1
_POLL_S = 0.002  # between two rounds of driving the transport and reading the witness channel


def experience(exc: BaseException) -> tuple[tuple[int, int, float], int]:
    """(status, peer) for this rank's record after ``exc``: what it met, on the link to whom."""
    if isinstance(exc, FrameMismatch):  # a frame of another call, or an alarm that woke it (its links are fine)
        return (OK if exc.tag == tags.ALARM else PROTOCOL, -1, 0.0), exc.peer
    status = (status_of(exc), -1, 0.0)
    if isinstance(exc, CollectiveTimeout):
        return status, exc.missing[0] if exc.missing else -1
    if isinstance(exc, (TransportError, ProtocolError)) and isinstance(exc.peer, int):
        return status, exc.peer
    return status, -1


def fail(coll: Coll, exc: BaseException | None, bad: tuple[int, float] | None = None) -> NoReturn:
    """Exchange records with every peer, then raise the verdict every rank reaches.

    ``exc`` is what went wrong on the data path (None when the data phase
    finished but the result is non-finite; ``bad`` then gives the first bad
    element and its value).
    """
    t = coll.t
    if exc is not None and closing(t) and not isinstance(exc, TransportClosed):
        # this rank closed its group meanwhile: whatever its links then did (a peer's record where its data was
        # due, a reset) is that close's doing
        peer = getattr(exc, "peer", None)
        exc = coll.translate(TransportClosed(str(exc), rank=t.rank, peer=peer), peer if type(peer) is int else -1)
    if exc is not None and (coll.pending is None or closing(t)):
        raise exc  # no lenient tags (data errors are reported as they are), or nothing left to talk over
    own = own_record(coll, exc)
    _witness.failing(t)
    ex = _Exchange(coll, own)
    if isinstance(exc, FrameMismatch) and exc.tag == tags.ALARM:
        ex.take(exc.peer, exc.payload)
    if coll.size > 1:
        ex.run()
    verdict(coll, ex.table(), ALARMS, own=exc, marker=bad)
    raise AssertionError("the verdict of a failed collective always raises")  # pragma: no cover


def own_record(coll: Coll, exc: BaseException | None) -> Record:
    """The record this rank sends after ``exc`` (None: a non-finite result).

    A rank whose own input was non-finite (``coll.status``) reports that,
    also when a peer's alarm woke it before the marked result came: that
    wake-up says nothing about its links, and its input is the root cause
    every rank must name.
    """
    if exc is None:
        return with_status(coll.desc, coll.status)
    status, peer = experience(exc)
    if coll.status is not None and status[0] == OK:
        return with_status(coll.desc, coll.status)
    return with_status(coll.desc, status, peer)


class _Exchange:
    """One rank's side of the error path: its record out, the others' in, until every peer is settled."""

    def __init__(self, coll: Coll, own: Record) -> None:
        self.coll, self.me, self.n = coll, coll.rank, coll.size
        self.records: list[Record | None] = [None] * self.n
        self.records[self.me] = own
        self.seen: dict[int, int] = {}  # peer -> status of what this rank met on the link to it
        self.board = _witness.of(coll.t)
        self.t0 = time.monotonic()

    def take(self, p: int, payload: bytes) -> None:
        """Note ``p``'s record (the first one that parses; a malformed one is noted as such)."""
        if self.records[p] is not None or not 0 <= p < self.n or p == self.me:
            return
        try:
            rec = unpack(payload, 1)[0] if len(payload) == RECORD_SIZE else None
        except ProtocolError:
            rec = None
        if rec is None:
            self.seen.setdefault(p, MALFORMED)
        else:
            self.records[p] = rec

    def table(self) -> list[Record]:
        return [r if r is not None else absent(self.seen.get(p, TIMEOUT)) for p, r in enumerate(self.records)]

    def run(self) -> None:
        t, me = self.coll.t, self.me
        mine = pack([self.records[me]])  # type: ignore[list-item]
        if self.board is not None:
            self.board.publish(bytes(mine))
        peers = [p for p in range(self.n) if p != me]
        sending: list[Request] = []  # driven to the end too: an alarm queued behind data frames reaches its peer
        for p in peers:                # only while someone drives this rank's transport, and after this rank
            try:                       # returns nobody does
                sending.append(t.isend(p, mine, tags.ALARM))
            except LINK_ERRORS as exc:
                self.seen.setdefault(p, status_of(exc))
        # Receives the data phase left behind come first: unstarted ones are withdrawn, one already
        # reading a frame finishes it (that frame may be p's alarm).
        listening: dict[int, list[tuple[Request, bytearray | None]]] = {p: [] for p in peers}
        for req, p in list((self.coll.pending or {}).items()):
            req.cancel()
            listening[p].append((req, None))
        if self.coll.pending:
            self.coll.pending.clear()
        for p in peers:
            self._post(p, listening)
        while True:
            self._read_board()
            moved = False
            for p in peers:
                moved |= self._listen(p, listening)
            sending = [req for req in sending if not req.test()]
            if not sending and all(self._settled(p) for p in peers) or time.monotonic() >= self._until():
                break
            if not moved:
                if self.board is not None:
                    self.board.wait_records(_POLL_S)
                else:
                    time.sleep(_POLL_S)
        for queue in listening.values():
            for req, _ in queue:
                req.cancel()

    def _post(self, p: int, listening: dict[int, list[tuple[Request, bytearray | None]]]) -> None:
        buf = bytearray(RECORD_SIZE)
        try:
            listening[p].append((self.coll.t.irecv(p, buf, tags.ALARM), buf))
        except LINK_ERRORS as exc:
            self.seen.setdefault(p, status_of(exc))

    def _listen(self, p: int, listening: dict[int, list[tuple[Request, bytearray | None]]]) -> bool:
        """Drive the receives from ``p`` in order; True if one finished."""
        queue, moved = listening[p], False
        while queue and queue[0][0].test():
            req, buf = queue.pop(0)
            moved = True
            try:
                req.wait(0.0)
                if buf is not None:
                    self.take(p, bytes(buf))
            except FrameMismatch as exc:
                if exc.tag == tags.ALARM:
                    self.take(exc.peer, exc.payload)
                if (exc.tag != tags.ALARM or exc.peer != p) and buf is not None and self.records[p] is None:
                    self._post(p, listening)  # a stray data frame went by: wait for the next one
            except CollectiveTimeout:
                if buf is not None:  # a leftover's own timeout is why this rank is here: the link is fine
                    self.seen.setdefault(p, TIMEOUT)
                    queue.clear()
            except LINK_ERRORS as exc:
                self.seen.setdefault(p, status_of(exc))
                queue.clear()
        return moved

    def _read_board(self) -> None:
        if self.board is not None:
            for p, payload in self.board.records().items():
                self.take(p, payload)

    def _settled(self, p: int) -> bool:
        """Nothing more will come from ``p``: its record came, it is dead, or (no witness channel) its link is gone."""
        if self.records[p] is not None:
            return True
        dead = self.seen.get(p) == BROKEN or any(r is not None and r.status == BROKEN and r.peer == p
                                                  for r in self.records)
        if dead:
            return self.board is None or time.monotonic() >= self.t0 + CONFIRM_S
        return self.board is None and p in self.seen

    def _until(self) -> float:
        """The grace deadline: shorter once a root cause is known."""
        rooted = any(is_root(s) for s in self.seen.values()) or any(
            r is not None and is_root(r.status) for r in self.records)
        timeout = self.coll.timeout
        if rooted:
            end = self.t0 + GRACE_ROOT
        elif timeout is None:
            end = self.t0 + GRACE_MAX
        else:
            end = self.coll.started + timeout + GRACE_END
        return min(self.t0 + GRACE_MAX, max(self.t0 + GRACE_MIN, end))
