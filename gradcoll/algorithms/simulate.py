"""Run the real allreduce code on many simulated ranks: each rank's virtual finishing time under a cost model.

``simulate`` runs one allreduce of ``gradcoll.algorithms.ALLREDUCE`` on
``n`` threads of this process, each with a ``SimTransport`` of one
``SimWorld`` (``gradcoll.model.sim``, where the clock rules are) and that
rank's ``SimKernels`` passed as the algorithm's ``backend=``:

* **Real**: the algorithm's whole control flow - which rank sends which
  chunk to whom, in which order, with which tags and lengths, the waits, the
  fold/unfold of recursive doubling, the star's root, the ring's schedule.
* **Simulated**: the payloads do not move and the reductions are not
  computed (they advance the calling rank's clock), so the results are
  meaningless; the run uses ``op="sum"``, ``check_finite=False``.
* **Virtual size**: the real buffer is ``n * elems_per_rank`` float32; every
  length is scaled to ``nbytes`` when the clocks advance, so a 1 GiB
  allreduce costs no memory.

The times equal the closed forms of ``gradcoll.costmodel.predict`` under the
conditions ``gradcoll.model.sim`` states; tests/model/test_costmodel.py
checks it. ``SimWorld``, ``SimTransport`` and ``SimKernels`` are importable
from here too (this module is also ``gradcoll.transport.sim``, their path
before the layered layout).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ..errors import UsageError
from ..model.costmodel import AlphaBeta
from ..model.sim import SimKernels, SimTransport, SimWorld
from . import ALLREDUCE

__all__ = ["simulate", "SimWorld", "SimTransport", "SimKernels"]


def simulate(algorithm: str, n: int, nbytes: int, model: AlphaBeta, *, elems_per_rank: int = 4,
             segment_bytes: int | None = None, timeout: float = 60.0, hosts: Sequence[Hashable] | None = None,
             local: AlphaBeta | None = None, cross: str = "ring") -> list[float]:
    """Run the real ``algorithm`` allreduce on ``n`` simulated ranks; each rank's virtual seconds.

    The buffer is ``n * elems_per_rank`` float32 standing for ``nbytes``.
    ``segment_bytes`` (the ring, and the two-level allreduce's ring between
    leaders) is in virtual bytes; None runs one segment per chunk, as the
    closed form assumes. ``hosts`` (a label per rank) and ``local`` (the
    model of the links inside a host) make a cluster of hosts
    (``gradcoll.model.sim``); the two-level allreduce gets the same
    ``hosts`` and runs ``cross`` between the leaders.
    """
    fn = ALLREDUCE.get(algorithm)
    if fn is None:
        raise UsageError(f"unknown algorithm {algorithm!r}")
    count = n * elems_per_rank
    scale = nbytes / (count * 4)
    world = SimWorld(n, model, scale, max(0.0, 1.0 - model.cache_bytes / nbytes) if nbytes > 0 else 0.0,
                     hosts=hosts, local=local)
    ts = [SimTransport(world, r, timeout) for r in range(n)]
    kw: dict[str, Any] = {"op": "sum", "check_finite": False}
    if algorithm in ("ring", "two_level"):
        kw["segment_bytes"] = 1 << 62 if segment_bytes is None else max(4, int(segment_bytes / scale))
    if algorithm == "two_level":
        kw.update(hosts=list(hosts) if hosts is not None else None, cross=cross)
    errors: list[BaseException] = []

    def rank_main(t: SimTransport) -> None:
        try:
            fn(t, np.zeros(count, np.float32), backend=t.kernels, **kw)
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(t,), daemon=True) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 5)
    if errors:
        raise errors[0]
    if any(th.is_alive() for th in threads):
        raise RuntimeError(f"simulated {algorithm} on {n} ranks did not finish")
    return [t.clock for t in ts]
