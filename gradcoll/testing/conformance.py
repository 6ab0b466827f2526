"""Running the conformance checks: ``check_transport``, ``run_check``, ``run_spmd`` and the dead-peer checks."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import TransportBroken, UsageError
from ..store import FileStore
from ..transport.base import Transport
from .capability_checks import CHECKS
from .checks import LARGE, Ctx, _raises
from .runners import run_ranks

__all__ = ["check_transport", "run_check", "run_spmd", "PROCESS_CHECKS"]


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
