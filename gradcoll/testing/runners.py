"""Ranks as threads of this process: one runner under ``run_ranks``, ``gather_ranks`` and ``threaded_group``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._util import Deadline
from ..store import HashStore
from ..transport.base import Transport

__all__ = ["run_ranks", "gather_ranks", "threaded_group"]


@dataclass
class _Outcome:
    """What ``_run_threads`` saw: per-rank results and errors, the ranks in the order they failed, the hung ones."""

    results: list[Any]
    errors: list[BaseException | None]
    failed: list[int] = field(default_factory=list)
    hung: list[int] = field(default_factory=list)


def _run_threads(fn: Callable[[int], Any], n: int, timeout: float, on_error: Callable[[], None] | None = None) -> _Outcome:
    """Run ``fn(rank)`` for ``rank`` in ``range(n)``, each on its own daemon thread, and join them all by ``timeout``.

    ``on_error`` runs once, on the thread of the first rank that fails (to
    unblock the others: close links, break barriers).
    """
    out = _Outcome([None] * n, [None] * n)
    lock = threading.Lock()

    def body(r: int) -> None:
        try:
            out.results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            with lock:
                out.errors[r] = e
                out.failed.append(r)
                first = len(out.failed) == 1
            if first and on_error is not None:
                on_error()

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank-{r}") for r in range(n)]
    deadline = Deadline(timeout)
    for th in threads:
        th.start()
    for th in threads:
        th.join(deadline.remaining())
    out.hung = [r for r, th in enumerate(threads) if th.is_alive()]
    return out


def run_ranks(fns: Sequence[Callable[[Any], Any]], args: Sequence[Any], *, timeout: float = 60.0,
              on_error: Callable[[], None] | None = None) -> list[Any]:
    """Run ``fns[r](args[r])`` for every rank in its own thread; return results, re-raise the first failure."""
    out = _run_threads(lambda r: fns[r](args[r]), len(args), timeout, on_error)
    if out.failed:
        r = out.failed[0]
        e = out.errors[r]
        raise AssertionError(f"rank {r} failed: {type(e).__name__}: {e}") from e
    if out.hung:
        if on_error is not None:
            on_error()
        raise AssertionError(f"ranks {out.hung} still running after {timeout}s (hang)")
    return out.results


def gather_ranks(fn: Callable[[int], Any], n: int, *, join_timeout: float = 60.0) -> tuple[list[Any], list[BaseException | None]]:
    """Run ``fn(rank)`` on ``n`` threads; return every rank's result and exception (None where it returned).

    Unlike ``run_ranks`` it never raises a rank's error: tests that expect
    every rank to fail in a given way inspect the list. It asserts that no rank
    is still running after ``join_timeout`` seconds (a hang).
    """
    out = _run_threads(fn, n, join_timeout)
    assert not out.hung, f"ranks {out.hung} still running after {join_timeout}s (hang)"
    return out.results, out.errors


def threaded_group(create: Callable[..., Transport], size: int, *, timeout: float = 30.0, **options: Any) -> list[Transport]:
    """Bootstrap ``size`` transports with ``create(store, rank, size, ...)`` in threads over one HashStore."""
    store = HashStore(timeout)
    made: list[Transport | None] = [None] * size

    def boot(rank: int) -> Transport:
        made[rank] = t = create(store, rank, size, timeout=timeout, **options)
        return t

    try:
        return run_ranks([boot] * size, list(range(size)), timeout=timeout + 5)
    except BaseException:
        for t in made:
            if t is not None:
                t.close()
        raise
