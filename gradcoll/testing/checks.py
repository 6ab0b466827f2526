"""The conformance checks: one small per-rank program per promise of the transport contract.

Each check is ``program(transport, ctx)`` for a world of ``Check.size``
ranks (0: any size >= 2); ``gradcoll.testing.conformance`` runs them with
ranks as threads or one rank per process. The contract is the docstring of
``gradcoll.transport.base``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from ..errors import CollectiveMismatch, CollectiveTimeout, TransportClosed, UsageError
from ..transport.base import Transport
from ..transport.frame import LENIENT_TAG, FrameMismatch

__all__ = ["Ctx", "Check", "CORE_CHECKS", "LARGE"]

LARGE = 32 << 20

_E = TypeVar("_E", bound=BaseException)


@dataclass
class Ctx:
    """What a check program gets besides its transport."""

    barrier: Callable[[], None]
    large: int = LARGE


@dataclass(frozen=True)
class Check:
    """A conformance check: a per-rank program for a world of ``size`` ranks (0: any size >= 2)."""

    name: str
    size: int
    program: Callable[[Transport, Ctx], None]


def _check(size: int) -> Callable[[Callable[[Transport, Ctx], None]], Check]:
    """Decorator: turn a rank program ``_name`` into the check ``name``."""
    return lambda fn: Check(fn.__name__.lstrip("_"), size, fn)


def _raises(cls: type[_E], fn: Callable[[], Any], *, rank: int | None = None, peer: int | None = None, within: float = 10.0) -> _E:
    """Assert ``fn()`` raises ``cls`` within ``within`` seconds, naming ``rank`` and ``peer``."""
    start = time.monotonic()
    try:
        fn()
    except cls as e:
        elapsed, msg = time.monotonic() - start, str(e)
        assert elapsed <= within, f"{cls.__name__} took {elapsed:.2f}s (limit {within}s): {msg}"
        assert rank is None or f"rank {rank}" in msg, f"message does not name rank {rank}: {msg}"
        assert peer is None or f"peer {peer}" in msg, f"message does not name peer {peer}: {msg}"
        # The collectives' error path reads who failed from the error itself, not from its text.
        if peer is not None and isinstance(e, CollectiveTimeout):
            assert e.missing == [peer], f"CollectiveTimeout.missing is {e.missing}, not [{peer}]: {msg}"
        elif peer is not None and hasattr(e, "peer"):
            assert e.peer == peer, f"{cls.__name__}.peer is {e.peer}, not {peer}: {msg}"
        return e
    raise AssertionError(f"expected {cls.__name__} from {fn}")


def _pattern(n: int, seed: int) -> np.ndarray:
    """``n`` bytes in which every 4-byte word differs, so misplaced chunks show."""
    words = np.arange(seed << 24, (seed << 24) + (n + 3) // 4, dtype=np.uint32)
    pattern: np.ndarray = words.view(np.uint8)[:n].copy()
    return pattern


@_check(1)
def _world_of_one(t: Transport, ctx: Ctx) -> None:
    assert (t.rank, t.size) == (0, 1)
    _raises(UsageError, lambda: t.isend(0, b"x"))
    _raises(UsageError, lambda: t.irecv(0, bytearray(1)))


@_check(2)
def _invalid_peer(t: Transport, ctx: Ctx) -> None:
    for bad in (t.rank, -1, t.size, 1.5, "1", None):
        _raises(UsageError, lambda bad=bad: t.isend(bad, b"x"))  # type: ignore[misc]
        _raises(UsageError, lambda bad=bad: t.recv(bad, bytearray(1), timeout=1))  # type: ignore[misc]


@_check(2)
def _bad_buffers(t: Transport, ctx: Ctx) -> None:
    other = 1 - t.rank
    _raises(UsageError, lambda: t.isend(other, np.zeros((4, 4), np.float32)[:, 1]))
    _raises(UsageError, lambda: t.irecv(other, b"read-only"))
    _raises(UsageError, lambda: t.irecv(other, np.zeros((4, 4))[::2]))


@_check(2)
def _ordering_and_tags(t: Transport, ctx: Ctx) -> None:
    other, sizes = 1 - t.rank, [0, 1, 7, 24, 100, 4096, 5000, 65536 + 3]
    for direction in (0, 1):
        for i in range(40):
            n, tag = sizes[i % len(sizes)], (i * 7919) % 100_003
            data = _pattern(n, i)
            if t.rank == direction:
                buf = (data, bytearray(data.tobytes()), memoryview(data.tobytes()), data.tobytes())[i % 4]
                t.send(other, buf, tag=tag, timeout=10)
            else:
                out = np.empty(n, np.uint8)
                assert t.recv(other, out, tag=tag, timeout=10) == n
                assert np.array_equal(out, data), f"message {i} corrupted"
    # typed buffers travel as their bytes
    vec = np.linspace(-1, 1, 1001, dtype=np.float32)
    if t.rank == 0:
        t.send(1, vec, tag=3, timeout=10)
    else:
        got = np.empty_like(vec)
        assert t.recv(0, got, tag=3, timeout=10) == vec.nbytes and np.array_equal(got, vec)


@_check(2)
def _many_outstanding(t: Transport, ctx: Ctx) -> None:
    other, n = 1 - t.rank, 12
    if t.rank == 0:
        reqs = [t.isend(other, _pattern(1000 * i, i), tag=i) for i in range(n)]
        for r in reqs:
            r.wait(10)
            assert r.test()
    else:
        outs = [np.empty(1000 * i, np.uint8) for i in range(n)]
        reqs = [t.irecv(other, outs[i], tag=i) for i in range(n)]
        for i in reversed(range(n)):  # waiting out of order still fills them in order
            assert reqs[i].wait(10) == 1000 * i
        assert all(r.test() for r in reqs)
        assert all(np.array_equal(outs[i], _pattern(1000 * i, i)) for i in range(n))


@_check(2)
def _zero_length(t: Transport, ctx: Ctx) -> None:
    other = 1 - t.rank
    for buf in (b"", np.empty(0, np.float64)):
        if t.rank == 0:
            t.send(other, buf, tag=9, timeout=10)
            assert t.recv(other, bytearray(0), tag=10, timeout=10) == 0
        else:
            assert t.recv(other, np.empty(0, np.uint8), tag=9, timeout=10) == 0
            t.send(other, buf, tag=10, timeout=10)
    assert t.sendrecv(other, b"", other, bytearray(0), tag=11, timeout=10) == 0


@_check(2)
def _large(t: Transport, ctx: Ctx) -> None:
    other = 1 - t.rank
    for sender in (0, 1):
        if t.rank == sender:
            t.send(other, _pattern(ctx.large, sender), tag=1, timeout=30)
        else:
            out = np.empty(ctx.large, np.uint8)
            assert t.recv(other, out, tag=1, timeout=30) == ctx.large
            assert np.array_equal(out, _pattern(ctx.large, sender)), "large message corrupted"


@_check(2)
def _sendrecv_duplex(t: Transport, ctx: Ctx) -> None:
    other = 1 - t.rank
    for n in (1, 4096, ctx.large):
        out = np.empty(n, np.uint8)
        assert t.sendrecv(other, _pattern(n, t.rank), other, out, tag=2, timeout=30) == n
        assert np.array_equal(out, _pattern(n, other)), f"sendrecv of {n} bytes corrupted"


@_check(0)
def _ring(t: Transport, ctx: Ctx) -> None:
    right, left = (t.rank + 1) % t.size, (t.rank - 1) % t.size
    for step, n in enumerate((1024, 1 << 20, 3, 1 << 20)):
        out = np.empty(n, np.uint8)
        t.sendrecv(right, _pattern(n, t.rank + step), left, out, tag=step, timeout=30)
        assert np.array_equal(out, _pattern(n, left + step)), f"ring step {step} corrupted"


def _mismatch(t: Transport, ctx: Ctx, sent: tuple[int, int], expected: tuple[int, int], what: str) -> None:
    """Rank 0 sends (tag, length) ``sent``, rank 1 expects ``expected``: a CollectiveMismatch that shows both."""
    if t.rank == 0:
        t.send(1, bytes(sent[1]), tag=sent[0], timeout=10)
    else:
        e = _raises(CollectiveMismatch, lambda: t.recv(0, bytearray(expected[1]), tag=expected[0], timeout=10), rank=1)
        shown = {"tags": (sent[0], expected[0]), "lengths": (sent[1], expected[1])}[what]
        assert all(str(v) in str(e) for v in shown), f"mismatch message must show both {what}: {e}"
    ctx.barrier()


@_check(2)
def _tag_mismatch(t: Transport, ctx: Ctx) -> None:
    _mismatch(t, ctx, (1234, 8), (4321, 8), "tags")


@_check(2)
def _length_mismatch(t: Transport, ctx: Ctx) -> None:
    _mismatch(t, ctx, (5, 1000), (5, 777), "lengths")


@_check(2)
def _timeouts(t: Transport, ctx: Ctx) -> None:
    if t.rank == 0:  # rank 1 sends nothing until the barrier
        for call in (lambda: t.recv(1, bytearray(8), timeout=0.5), lambda: t.sendrecv(1, b"x", 1, bytearray(8), timeout=0.5)):
            start = time.monotonic()
            e = _raises(CollectiveTimeout, call, rank=0, peer=1, within=1.5)
            assert time.monotonic() - start >= 0.45, f"timed out early: {e}"
    ctx.barrier()


@_check(2)
def _peer_closes(t: Transport, ctx: Ctx) -> None:
    if t.rank == 1:
        t.send(0, b"last words", tag=7, timeout=10)
        t.close()
        t.close()  # idempotent
        assert t.closed
        _raises(TransportClosed, lambda: t.isend(0, b"x"), rank=1)
    else:
        out = bytearray(10)
        assert t.recv(1, out, tag=7, timeout=10) == 10 and out == b"last words", "data sent before close lost"
        _raises(TransportClosed, lambda: t.recv(1, bytearray(1), timeout=10), rank=0, peer=1)
        _raises(TransportClosed, lambda: t.send(1, b"x", timeout=10), rank=0, peer=1)


@_check(2)
def _close_wakes_waiter(t: Transport, ctx: Ctx) -> None:
    if t.rank == 0:  # a thread blocked in recv on a transport that another thread closes
        caught: list[BaseException] = []
        waiter = threading.Thread(target=lambda: caught.append(_raises(TransportClosed, lambda: t.recv(1, bytearray(4), timeout=10))))
        waiter.start()
        ctx.barrier()
        t.close()
        waiter.join(10)
        assert not waiter.is_alive() and caught, "close() did not wake a blocked recv"
    else:
        ctx.barrier()
        _raises(TransportClosed, lambda: t.recv(0, bytearray(4), timeout=10), rank=1, peer=0)


@_check(2)
def _shared_by_threads(t: Transport, ctx: Ctx) -> None:
    """Two threads use one transport at once: one sends, the other receives."""
    other, n = 1 - t.rank, 200
    failures: list[BaseException] = []

    def sender() -> None:
        try:
            for i in range(n):
                t.send(other, _pattern(100 + i, i), tag=1, timeout=20)
        except BaseException as e:  # noqa: BLE001 - checked below
            failures.append(e)

    th = threading.Thread(target=sender)
    th.start()
    for i in range(n):
        out = np.empty(100 + i, np.uint8)
        t.recv(other, out, tag=1, timeout=20)
        assert np.array_equal(out, _pattern(100 + i, i)), f"message {i} corrupted"
    th.join(20)
    assert not th.is_alive() and not failures, failures


@_check(2)
def _cancel_unstarted_recv(t: Transport, ctx: Ctx) -> None:
    """A receive withdrawn before any byte moved takes no message: the next receive gets it."""
    if t.rank == 1:
        first, second = bytearray(8), bytearray(8)
        withdrawn, kept = t.irecv(0, first, tag=21), t.irecv(0, second, tag=21)
        assert withdrawn.cancel() is True, "cancel() of a receive no byte of which has moved must withdraw it"
        assert withdrawn.test() and withdrawn.wait(1) == 0, "a withdrawn receive is done and moved 0 bytes"
        ctx.barrier()  # only now does rank 0 send
        assert kept.wait(10) == 8 and second == b"message1", f"the first message went astray: {bytes(second)!r}"
        out = bytearray(8)
        assert t.recv(0, out, tag=21, timeout=10) == 8 and out == b"message2", "the message after it was lost"
        assert first == bytearray(8), "a withdrawn receive's buffer was written"
    else:
        ctx.barrier()
        t.send(1, b"message1", tag=21, timeout=10)
        t.send(1, b"message2", tag=21, timeout=10)
    ctx.barrier()


@_check(2)
def _cancel_finished(t: Transport, ctx: Ctx) -> None:
    """cancel() of an operation that has finished is True and changes nothing."""
    other, out = 1 - t.rank, bytearray(4)
    if t.rank == 0:
        sreq = t.isend(other, b"done", tag=22)
        sreq.wait(10)
        assert sreq.cancel() is True, "cancel() of a finished send must be True"
    rreq = t.irecv(other, out, tag=23 - t.rank)
    if t.rank == 1:
        assert rreq.wait(10) == 4
        t.send(other, b"back", tag=23, timeout=10)
    else:
        assert rreq.wait(10) == 4
    assert rreq.cancel() is True, "cancel() of a finished receive must be True"
    assert rreq.test() and rreq.wait(1) == 4, "cancel() undid a finished receive"
    assert bytes(out) == (b"back" if t.rank == 0 else b"done")


@_check(2)
def _lenient_mismatch(t: Transport, ctx: Ctx) -> None:
    """With ``lenient_tags``, a lenient receive fails with the lenient frame it met instead, and the link stays in step."""
    if not t.lenient_tags:
        return  # such a transport drops the link instead (tag_mismatch checks that)
    want = LENIENT_TAG + 2
    strays = [(LENIENT_TAG + 1, 3), (LENIENT_TAG + 1, 100_000), (want, 9)]  # (tag, length) met by a recv of (want, 8)
    if t.rank == 0:
        reqs = []
        for i, (tag, n) in enumerate(strays):
            reqs += [t.isend(1, _pattern(n, i), tag=tag), t.isend(1, _pattern(8, 10 + i), tag=want)]
        ctx.barrier()  # all of it is queued before rank 1 reads: a read may run past the stray frame
        for req in reqs:
            req.wait(30)
    else:
        ctx.barrier()
        for i, (tag, n) in enumerate(strays):
            out = np.zeros(8, np.uint8)
            e = _raises(FrameMismatch, functools.partial(t.recv, 0, out, tag=want, timeout=10), rank=1, peer=0)
            assert (e.peer, e.tag, len(e.payload)) == (0, tag, n), f"FrameMismatch carries the wrong frame: {e}"
            assert e.payload == _pattern(n, i).tobytes(), "FrameMismatch carries a corrupted payload"
            assert t.recv(0, out, tag=want, timeout=10) == 8, "the link is out of step after a stray frame"
            assert np.array_equal(out, _pattern(8, 10 + i)), "the message after a stray frame is corrupted"
    out = np.empty(64, np.uint8)  # and both directions still work
    t.sendrecv(1 - t.rank, _pattern(64, t.rank), 1 - t.rank, out, tag=want, timeout=10)
    assert np.array_equal(out, _pattern(64, 1 - t.rank)), "sendrecv after stray frames corrupted"


@_check(0)
def _note_wait(t: Transport, ctx: Ctx) -> None:
    """``note_wait`` adds to this transport's ``blocked_s`` and to no other's."""
    before = t.blocked_s
    t.note_wait(0.25)
    t.note_wait(0.5)
    ctx.barrier()  # every rank has added its own
    assert abs(t.blocked_s - before - 0.75) < 1e-9, f"blocked_s went from {before} to {t.blocked_s} after 0.75 s"


#: The core thread-mode checks by name, in the order check_transport runs them (``capability_checks`` adds the
#: capability tiers: ``CHECKS``).
CORE_CHECKS: Mapping[str, Check] = MappingProxyType({c.name: c for c in (
    _world_of_one, _invalid_peer, _bad_buffers, _ordering_and_tags, _many_outstanding,
    _zero_length, _large, _sendrecv_duplex, _ring, _tag_mismatch, _length_mismatch,
    _timeouts, _peer_closes, _close_wakes_waiter, _shared_by_threads,
    _cancel_unstarted_recv, _cancel_finished, _lenient_mismatch, _note_wait,
)})
