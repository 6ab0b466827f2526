"""The halving-doubling allreduce of a power-of-two group in one compiled call, in the guard's frame without its
happy-path costs (``halving_doubling_allreduce``'s fast path, as ``recursive_doubling._stepped`` is recursive
doubling's).

The same descriptor tag as the guard (so a rank on the general path meets the same frames), every round of
the reduce-scatter and the allgather in one ``Transport.exchange_plan`` call (tcp's), the input's finite check
inside its first round, and the guard's marker check on the result (the first element of every chunk). A call
the transport declines before a byte moves (another thread's work queued, a secret on a link, an input not
finite in its first piece) goes to the guard. A round that stopped early was finished by the engine, and the
rounds after it run as the guard's body runs them (``hd_pass`` with the compiled step), in a ``Coll`` built as
the guard would have built it; every error goes through the guard's error path (``fail``).
"""

from __future__ import annotations

import array
import math
import time
from typing import Any

import numpy as np

from ..transport.base import Transport
from ..transport.plan import COPY, DIVIDE, make, set_tags
from . import tags
from ._common import Coll, Options, Workspace, chunk_bounds, scratch
from ._guard import ERRORS, fail, lean_frame
from ._verdict import NONFINITE

__all__ = ["planned", "plan_arrays", "hd_schedule"]

NAME = "halving-doubling allreduce"


def hd_schedule(v: int, p: int) -> list[tuple[int, int, int, int, int]]:
    """The reduce-scatter rounds of active rank ``v`` of ``p``: ``(partner, keep_lo, keep_hi, send_lo, send_hi)``.

    Bounds are chunk indices (of ``p`` chunks). The allgather runs the same
    rounds backwards: in round ``k`` it sends ``keep`` and receives ``send``.
    """
    lo, hi = 0, p
    out: list[tuple[int, int, int, int, int]] = []
    for k in range(p.bit_length() - 1):
        mid = (lo + hi) // 2
        if (v >> k) & 1:
            out.append((v ^ (1 << k), mid, hi, lo, mid))
            lo = mid
        else:
            out.append((v ^ (1 << k), lo, mid, mid, hi))
            hi = mid
    return out


def plan_arrays(plan: list[tuple[int, int, int, int, int]], bounds: list[int],
                mean: bool) -> tuple[tuple[int, ...], array.array[int]]:
    """``exchange_plan``'s peers and plan (``gradcoll.transport.plan``, the tags left to each call) for ``plan``
    (``hd_schedule``'s, a power-of-two group): the reduce-scatter rounds (send ``[c, d)``, add into ``[a, b)``;
    the last divides a mean), then the allgather's in reverse (send what the round kept, copy in what it
    sent)."""
    rounds = [(0, bounds[klo], bounds[khi], bounds[slo], bounds[shi], DIVIDE if mean and k == len(plan) - 1 else 0)
              for k, (_, klo, khi, slo, shi) in enumerate(plan)]
    rounds += [(0, bounds[slo], bounds[shi], bounds[klo], bounds[khi], COPY) for _, klo, khi, slo, shi in reversed(plan)]
    return tuple(p[0] for p in plan) + tuple(p[0] for p in reversed(plan)), make(rounds)


def planned(t: Transport, buf: np.ndarray, op: str, check: bool, seq: int, timeout: float | None,
            ws: Workspace | None, rest: Any) -> bool:
    """The allreduce of ``buf`` with every round in one compiled call; False: declined, nothing moved (the guard's
    path runs it). ``rest(coll, flat, opts, done)`` runs the rounds from ``done`` on (``hd_pass``)."""
    frame = lean_frame(t, buf, "exchange_plan", "halving_doubling", op, check, seq, timeout)
    if frame is None:
        return False
    flat, desc, tag0, limit, started = frame
    run, n = t.exchange_plan, t.size  # type: ignore[attr-defined]
    key = (flat.size, op == "mean")
    cache: dict[Any, Any] = t.__dict__.setdefault("_hd_plans", {})
    got = cache.get(key)
    if got is None:
        bounds = chunk_bounds(flat.size, n)
        got = cache[key] = (bounds, *plan_arrays(hd_schedule(t.rank, n), bounds, op == "mean"))
    bounds, peers, spec = got
    rounds = len(peers) // 2
    half = bounds[n // 2]
    tmp = scratch(ws, "hd", max(flat.size - half, half, 1), flat.dtype)
    found: list[tuple[int, float]] = []
    at = [0]
    t0 = time.perf_counter()
    try:
        set_tags(spec, [tag0 + tags.HD_RS] * rounds + [tag0 + tags.HD_AG] * rounds)
        done = int(run(peers, flat, tmp, spec, max(0.0, started + limit - time.monotonic()), n, check, found, at))
    except ERRORS as exc:
        fail(_coll(t, flat, seq, limit, started, desc, tag0, rounds, at[0], found), exc)
    finally:
        t.note_wait(time.perf_counter() - t0)  # as Coll.sendrecv counts it (ProcessGroup.stats() "wait time")
    if done == 0:
        return False
    coll = _coll(t, flat, seq, limit, started, desc, tag0, rounds, done, found) if found or done < 2 * rounds else None
    if coll is not None and done < 2 * rounds:
        try:
            rest(coll, flat, Options(op, check, seq, limit, ws, None), done)
        except ERRORS as exc:
            fail(coll, exc)
    if check and flat.size:
        for c in range(n):  # the guard's marker check: the first element of every chunk
            a = bounds[c]
            if bounds[c + 1] > a and not math.isfinite(flat[a]):
                fail(coll or _coll(t, flat, seq, limit, started, desc, tag0, rounds, 2 * rounds - 1, found), None,
                     (a, float(flat[a])))
    return True


def _coll(t: Transport, flat: np.ndarray, seq: int, limit: float, started: float, desc: tuple[int, ...], tag0: int,
          rounds: int, k: int, found: list[tuple[int, float]]) -> Coll:
    """The ``Coll`` the guard would have run this call with, at round ``k`` (of ``2 rounds``): for the error path
    and the rounds after a stopped one. ``found``: this rank's non-finite input element, as the guard's local
    check reports it."""
    coll = Coll(t, NAME, seq, flat.nbytes, limit)
    if found:
        coll.status = (NONFINITE, int(found[0][0]), float(found[0][1]))
    coll.started, coll.desc, coll.tag0, coll.pending = started, desc, tag0, {}
    coll.begin(2 * rounds)
    coll.deadline.at = started + limit  # the call's deadline, not a fresh one
    coll.step = min(k, 2 * rounds - 1) + 1
    return coll
