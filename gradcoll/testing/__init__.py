"""Test helpers, above all ``check_transport``: the suite every transport passes.

Each check is a small per-rank program ``program(transport, ctx)``. The same
programs run with ranks as threads (``run_check`` over a ``make_group``
factory, e.g. ``threaded_group`` or the in-process transport's), or one
rank per process (``run_spmd``, e.g. under ``mpirun``). Process checks
(``PROCESS_CHECKS``) kill a real peer process and need the transport's
``create`` function; they bootstrap through a [`FileStore`][gradcoll.store.FileStore].

The suite covers ordering, tags, zero-length and large messages, full-duplex
``sendrecv`` (pair and ring), tag/length mismatches, timeouts, orderly close
by the peer and locally, invalid peers and buffers, and dead peers.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from ..errors import CollectiveMismatch, CollectiveTimeout, TransportBroken, TransportClosed, UsageError
from ..store import FileStore, HashStore
from ..transport.base import Deadline, Transport

__all__ = [
    "threaded_group",
    "run_ranks",
    "gather_ranks",
    "check_transport",
    "run_check",
    "run_spmd",
    "CHECKS",
    "PROCESS_CHECKS",
]

LARGE = 32 << 20

_E = TypeVar("_E", bound=BaseException)


def threaded_group(create: Callable[..., Transport], size: int, *, timeout: float = 30.0, **options: Any) -> list[Transport]:
    """Bootstrap ``size`` transports with ``create(store, rank, size, ...)`` in threads over one HashStore."""
    store = HashStore(timeout)
    out: list[Transport | None] = [None] * size

    def boot(rank: int) -> Transport:
        t = create(store, rank, size, timeout=timeout, **options)
        out[rank] = t
        return t

    try:
        run_ranks([boot] * size, list(range(size)), timeout=timeout + 5)
    except BaseException:
        for t in out:
            if t is not None:
                t.close()
        raise
    return [t for t in out if t is not None]  # run_ranks returned, so every rank booted


def run_ranks(fns: Sequence[Callable[[Any], Any]], args: Sequence[Any], *, timeout: float = 60.0, on_error: Callable[[], None] | None = None) -> list[Any]:
    """Run ``fns[r](args[r])`` for every rank in its own thread; return results, re-raise the first failure."""
    results: list[Any] = [None] * len(args)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(r: int) -> None:
        try:
            results[r] = fns[r](args[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            with lock:
                errors.append((r, e))
                first = len(errors) == 1
            if first and on_error is not None:
                on_error()  # unblock the other ranks (close links, break barriers)

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank-{r}") for r in range(len(args))]
    deadline = Deadline(timeout)
    for th in threads:
        th.start()
    for th in threads:
        th.join(deadline.remaining())
    hung = [r for r, th in enumerate(threads) if th.is_alive()]
    if errors:
        r, e = errors[0]
        raise AssertionError(f"rank {r} failed: {type(e).__name__}: {e}") from e
    if hung:
        if on_error is not None:
            on_error()
        raise AssertionError(f"ranks {hung} still running after {timeout}s (hang)")
    return results


def gather_ranks(fn: Callable[[int], Any], n: int, *, join_timeout: float = 60.0) -> tuple[list[Any], list[BaseException | None]]:
    """Run ``fn(rank)`` on ``n`` threads; return every rank's result and exception (None where it returned).

    Unlike ``run_ranks`` it never raises a rank's error: tests that expect
    every rank to fail in a given way inspect the list. It asserts that no rank
    is still running after ``join_timeout`` seconds (a hang).
    """
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank-{r}") for r in range(n)]
    deadline = Deadline(join_timeout)
    for th in threads:
        th.start()
    for th in threads:
        th.join(deadline.remaining())
    hung = [r for r, th in enumerate(threads) if th.is_alive()]
    assert not hung, f"ranks {hung} still running after {join_timeout}s (hang)"
    return results, errors


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


@_check(2)
def _tag_mismatch(t: Transport, ctx: Ctx) -> None:
    if t.rank == 0:
        t.send(1, b"12345678", tag=1234, timeout=10)
    else:
        e = _raises(CollectiveMismatch, lambda: t.recv(0, bytearray(8), tag=4321, timeout=10), rank=1)
        assert "1234" in str(e) and "4321" in str(e), f"mismatch message must show both tags: {e}"
    ctx.barrier()


@_check(2)
def _length_mismatch(t: Transport, ctx: Ctx) -> None:
    if t.rank == 0:
        t.send(1, bytes(1000), tag=5, timeout=10)
    else:
        e = _raises(CollectiveMismatch, lambda: t.recv(0, bytearray(777), tag=5, timeout=10), rank=1)
        assert "1000" in str(e) and "777" in str(e), f"mismatch message must show both lengths: {e}"
    ctx.barrier()


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


#: Every thread-mode check by name, in the order check_transport runs them.
CHECKS: Mapping[str, Check] = MappingProxyType({c.name: c for c in (
    _world_of_one, _invalid_peer, _bad_buffers, _ordering_and_tags, _many_outstanding,
    _zero_length, _large, _sendrecv_duplex, _ring, _tag_mismatch, _length_mismatch,
    _timeouts, _peer_closes, _close_wakes_waiter, _shared_by_threads,
)})


# -- dead peers: rank 1 is a real process that gets SIGKILLed --------------------
PROCESS_CHECKS = ("dead_peer_recv", "dead_peer_send")
DEAD_SEND = 64 << 20  # more than any socket buffers or ring can absorb


def _victim(create: Callable[..., Transport], path: str, options: dict[str, Any]) -> None:
    t = create(FileStore(path, timeout=30), 1, 2, timeout=30, **options)
    t.send(0, b"ready", tag=1, timeout=30)
    threading.Event().wait(60)  # idle until killed


def _dead_peer(create: Callable[..., Transport], options: dict[str, Any], op: str) -> None:
    with tempfile.TemporaryDirectory(prefix="gradcoll-check-") as tmp:
        path = os.path.join(tmp, "store")
        store = FileStore(path, timeout=30)
        proc = multiprocessing.get_context("spawn").Process(target=_victim, args=(create, path, options), daemon=True)
        proc.start()
        try:
            t = create(store, 0, 2, timeout=30, **options)
            try:
                t.recv(1, bytearray(5), tag=1, timeout=30)
                proc.kill()  # not reaped yet: detection must not rely on the parent waiting
                if op == "recv":
                    _raises(TransportBroken, lambda: t.recv(1, bytearray(8), tag=2, timeout=15), rank=0, peer=1)
                else:
                    big = np.zeros(DEAD_SEND, np.uint8)
                    _raises(TransportBroken, lambda: t.send(1, big, tag=2, timeout=15), rank=0, peer=1)
            finally:
                t.close()
        finally:
            proc.kill()
            proc.join(10)
            store.close()


def run_check(
    name: str,
    make_group: Callable[[int], Sequence[Transport]] | None = None,
    *,
    create: Callable[..., Transport] | None = None,
    options: dict[str, Any] | None = None,
    size: int = 3,
    large: int = LARGE,
    timeout: float = 60.0,
) -> None:
    """Run one check: ranks as threads over ``make_group(size)``, or a dead-peer check with ``create``."""
    if name in PROCESS_CHECKS:
        if create is None:
            raise UsageError(f"check {name} needs the transport's create function")
        _dead_peer(create, options or {}, name.rsplit("_", 1)[1])
        return
    if make_group is None:
        raise UsageError(f"check {name} needs make_group")
    check = CHECKS[name]
    n = check.size or size
    group = list(make_group(n))
    assert [t.rank for t in group] == list(range(n)) and all(t.size == n for t in group), "make_group built a wrong group"
    barrier = threading.Barrier(n, timeout=timeout)

    def abort() -> None:
        barrier.abort()
        for t in group:
            t.close()

    try:
        def sync() -> None:
            barrier.wait()

        ctx = Ctx(sync, large)
        run_ranks([lambda t: check.program(t, ctx)] * n, group, timeout=timeout, on_error=abort)
    finally:
        for t in group:
            t.close()


def check_transport(make_group: Callable[[int], Sequence[Transport]], **kwargs: Any) -> None:
    """Run every check (and, given ``create=``, the dead-peer checks); raise on the first failure."""
    for name in CHECKS:
        run_check(name, make_group, **kwargs)
    if kwargs.get("create") is not None:
        for name in PROCESS_CHECKS:
            run_check(name, make_group, **kwargs)


def run_spmd(make_transport: Callable[[], Transport], barrier: Callable[[], None], *, large: int = LARGE, only: Sequence[str] | None = None) -> list[str]:
    """Run the checks with this process as one rank (e.g. under mpirun); return the names run."""
    ran = []
    for name, check in CHECKS.items():
        if only is not None and name not in only:
            continue
        t = make_transport()
        try:
            if check.size not in (0, t.size) or (check.size == 0 and t.size < 2):
                continue
            check.program(t, Ctx(barrier, large))
            ran.append(name)
        finally:
            t.close()
            barrier()
    return ran
