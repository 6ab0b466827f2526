"""The two-level allreduce's steps inside a host over a shared window (``intra="window"``).

Where the group reaches the ranks of this host through shared memory (a
``RoutedTransport`` whose ``local`` transport maps windows: a tcp group's
same-host links), steps 1 and 3 go through one window per host instead of
messages. Every member owns a slot of ``SLOT_BYTES``: two *up* buffers and
two *down* buffers of ``PIECE_BYTES``. A buffer goes in pieces of
``PIECE_BYTES``; piece ``k`` of a call uses up (and down) buffer ``k % 2``,
so one piece is copied in while the one before is reduced, and a call of one
piece touches one buffer of each kind whatever calls came before (indexing
by the pieces' running count instead alternated the buffers from call to
call: twice the memory a host keeps warm).

1. **Up**: every member copies piece ``k`` of its buffer into its up buffer
   and publishes counter ``UP``; the leader waits for every member's, adds
   its own piece and the members' rows in member order with the fused
   kernel, straight into its own buffer (the star's one pass, every element
   checked; a non-finite sum is planted at element 0), and publishes
   ``READ``: the members may reuse that up buffer. The leader's own piece is
   read where it lies, not copied into its slot first.
2. (the leaders' step, unchanged)
3. **Down**: the leader copies piece ``k`` of the result into its down
   buffer and publishes ``DOWN``; every member copies it out and publishes
   ``GOT``: the leader may reuse that down buffer.

Waits sleep in the kernel (the window's futex) once the machine's ranks
outnumber its cores, so a member waiting for the result leaves its core to
the leaders. Each rank's call (its descriptor tag and byte count) sits in
its window report; the leader compares every member's with its own at the
first piece, and a member that called something else is a ``FrameMismatch``
naming it, as a frame of another call would be. Any error of a rank inside
the two-level allreduce raises the window's alarm with that rank's record
(``raise_alarm``), which wakes every waiter of the host at once: the other
ranks enter the error path as if the alarm had come over a link, and the
records of every rank settle the verdict as for every allreduce. Window
errors name host ranks; they are raised in the group's numbering.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from ..errors import CollectiveTimeout, NonFiniteError, UsageError
from ..kernels import mean_reduce
from ..transport.base import Transport, Window, WindowAlarm
from ..transport.frame import FrameMismatch
from ..transport.routed import RoutedTransport
from . import tags
from ._alarm import own_record
from ._common import TRANSLATED, Coll, Options, plant
from ._handshake import pack

__all__ = ["available", "window_up", "window_down", "raise_alarm", "PIECE_BYTES", "SLOT_BYTES"]

#: Bytes of one piece; a slot holds two up and two down buffers of it.
PIECE_BYTES = 1 << 20
SLOT_BYTES = 4 * PIECE_BYTES
#: The window counters: a rank's last up piece in its slot, the leader's last piece reduced, its last result piece
#: in its down buffer, a member's last result piece copied out (each the piece's tick + 1).
UP, READ, DOWN, GOT = 0, 1, 2, 3
_MASK = (1 << 64) - 1


class _Host:
    """One host's window and the next up and down ticks (the same on every rank of the host)."""

    __slots__ = ("win", "up", "down")

    def __init__(self, win: Window) -> None:
        self.win, self.up, self.down = win, 0, 0


_HOSTS: weakref.WeakKeyDictionary[Transport, _Host] = weakref.WeakKeyDictionary()


def available(t: Transport, members: list[int] | None = None) -> bool:
    """Whether ``t`` reaches this host's ranks (``members``, this rank's host in the layout the call was given;
    None: any) through a transport that maps shared windows."""
    return isinstance(t, RoutedTransport) and bool(t.local.shared_memory) and (members is None or
                                                                               list(members) == t.members)


def _host(coll: Coll) -> tuple[RoutedTransport, _Host]:
    t = coll.t
    if not isinstance(t, RoutedTransport):  # pragma: no cover - INTRA["auto"] checks ``available`` first
        raise UsageError(f"rank {coll.rank}: the window steps of the two-level allreduce need a routed transport")
    host = _HOSTS.get(t)
    if host is None:  # collective over the host's ranks, at the first call every one of them makes
        host = _Host(_wait(coll, t, lambda: t.local.window(SLOT_BYTES, coll.deadline.remaining())))
        _HOSTS[t] = host
    return t, host


def _wait(coll: Coll, t: RoutedTransport, fn: Any) -> Any:
    """``fn()`` (a window wait or the window's creation), its errors in the group's numbering."""
    t0 = time.perf_counter()
    try:
        return fn()
    except WindowAlarm as exc:  # another rank of the host failed: as if its alarm had come over the link
        peer = _group_rank(t, exc.peer)
        raise FrameMismatch(f"rank {coll.rank}: rank {peer} raised an alarm on this host's window during "
                            f"{coll.where()}", peer=peer, tag=tags.ALARM, payload=bytes(exc.record)) from exc
    except TRANSLATED as exc:
        missing = getattr(exc, "missing", None) if isinstance(exc, CollectiveTimeout) else None
        raise coll.translate(exc, _group_rank(t, missing[0] if missing else getattr(exc, "peer", None))) from exc
    finally:
        t.note_wait(time.perf_counter() - t0)


def _group_rank(t: RoutedTransport, local: object) -> int:
    return t.members[local] if isinstance(local, int) and 0 <= local < len(t.members) else -1


def raise_alarm(coll: Coll, exc: BaseException) -> None:
    """This rank's collective failed with ``exc``: wake every rank of its host waiting on the window."""
    host = _HOSTS.get(coll.t)
    if host is not None and not host.win.closed:
        try:
            host.win.alarm(bytes(pack([own_record(coll, exc)])))
        except Exception:  # noqa: BLE001 - best effort: the error path reaches the host's ranks over its links too
            pass


def _start(coll: Coll, flat: np.ndarray, up: bool) -> tuple[RoutedTransport, Window, int, np.ndarray, int, int]:
    """(transport, window, this rank's slot, the buffer's bytes, its pieces, the first piece's tick) of a step."""
    t, host = _host(coll)
    raw = flat.view(np.uint8)
    count = max(1, -(-raw.size // PIECE_BYTES))
    if up:
        base, host.up = host.up, host.up + count
    else:
        base, host.down = host.down, host.down + count
    return t, host.win, t.local.rank, raw, count, base


def window_up(coll: Coll, flat: np.ndarray, opts: Options, members: list[int]) -> None:
    """Step 1: every rank's pieces into its slot, the leader's sum of the slots into its buffer."""
    if len(members) == 1:
        return
    t, win, me, raw, count, base = _start(coll, flat, True)
    report = win.report(me)[:16].view(np.uint64)
    report[0], report[1] = coll.tag0 & _MASK, raw.size
    others = range(1, len(members))
    for k in range(count):
        tick, lo = base + k, k * PIECE_BYTES
        hi = min(raw.size, lo + PIECE_BYTES)
        at = _buffer(k)
        if me:
            ready = _reused(tick, k, base)
            if ready:  # the leader has reduced what used this buffer last (``_reused``)
                _wait(coll, t, lambda ready=ready: win.wait([0], READ, ready, coll.deadline.remaining()))
            win.slot(me)[at: at + hi - lo] = raw[lo:hi]
            win.publish(UP, tick + 1)
            continue
        _wait(coll, t, lambda tick=tick: win.wait(others, UP, tick + 1, coll.deadline.remaining()))
        if k == 0:
            _check_calls(coll, t, win, report)
        piece = raw[lo:hi].view(flat.dtype)
        rows = [piece] + [win.slot(r)[at: at + hi - lo].view(flat.dtype) for r in others]
        if hi > lo:
            _reduce(rows, piece, flat, opts)  # into the leader's own piece, which it reads in the same pass
        win.publish(READ, tick + 1)


def _buffer(k: int) -> int:
    """The offset in a slot of piece ``k``'s up buffer (its down buffer: ``2 * PIECE_BYTES`` on)."""
    return (k % 2) * PIECE_BYTES


def _reused(tick: int, k: int, base: int) -> int:
    """The counter value (``READ`` of the leader, ``GOT`` of the members) that frees piece ``k``'s buffer
    (tick ``tick`` of a call whose first piece is tick ``base``): piece ``k - 2`` done, or every piece of the
    calls before (the only ones that used it before pieces 0 and 1); 0 where nothing did."""
    return tick - 1 if k >= 2 else base


def _check_calls(coll: Coll, t: RoutedTransport, win: Window, mine: np.ndarray) -> None:
    """The leader: every member called what it did (descriptor tag and bytes), else a FrameMismatch naming it."""
    for r in range(1, win.size):
        theirs = win.report(r)[:16].view(np.uint64)
        if theirs[0] != mine[0] or theirs[1] != mine[1]:
            peer = t.members[r]
            raise FrameMismatch(f"rank {coll.rank}: rank {peer} put another call's buffer ({int(theirs[1])} bytes) "
                                f"into this host's window during {coll.where()}", peer=peer, tag=int(theirs[0]),
                                payload=b"")


def _reduce(rows: list[np.ndarray], out: np.ndarray, flat: np.ndarray, opts: Options) -> None:
    """The rows' sum (or mean, max, min) in member order into ``out``; a non-finite sum marked at element 0."""
    if opts.op in ("mean", "sum"):
        try:
            mean_reduce(rows, out=out, op=opts.op, check_finite=opts.check_finite, backend=opts.backend)
        except NonFiniteError:
            plant(flat)
        return
    ufunc = np.maximum if opts.op == "max" else np.minimum
    np.copyto(out, rows[0])
    for row in rows[1:]:
        ufunc(out, row, out=out)


def window_down(coll: Coll, flat: np.ndarray, members: list[int]) -> None:
    """Step 3: the leader's result through its down buffers into every member's buffer."""
    if len(members) == 1:
        return
    t, win, me, raw, count, base = _start(coll, flat, False)
    others = range(1, len(members))
    for k in range(count):
        tick, lo = base + k, k * PIECE_BYTES
        hi = min(raw.size, lo + PIECE_BYTES)
        at = 2 * PIECE_BYTES + _buffer(k)
        if me == 0:
            ready = _reused(tick, k, base)
            if ready:  # every member has copied out what used this buffer last (``_reused``)
                _wait(coll, t, lambda ready=ready: win.wait(others, GOT, ready, coll.deadline.remaining()))
            win.slot(0)[at: at + hi - lo] = raw[lo:hi]
            win.publish(DOWN, tick + 1)
            continue
        _wait(coll, t, lambda tick=tick: win.wait([0], DOWN, tick + 1, coll.deadline.remaining()))
        raw[lo:hi] = win.slot(0)[at: at + hi - lo]
        win.publish(GOT, tick + 1)
