"""``ProcessGroup.allreduce``'s fast paths: the plain calls ``auto`` sends to one algorithm, in fewer steps.

A plain call is a native float32/float64 NumPy array, C-contiguous and
writeable, not ``async_op``. Two paths take it:

* one host (the transport offers a shared window), ``algorithm="auto"``:
  the direct allreduce (``gradcoll.algorithms.direct.hot_allreduce``), in
  every variant it runs;
* a group over a transport with an exchange-and-reduce step (tcp), where
  ``auto`` picks, for the size, recursive doubling or halving-doubling in a
  power-of-two group, or the ring in any (with the group's default
  segments), or the call names one of them: that allreduce, which runs its
  rounds in one compiled call. A named one took the general path before: on
  4 ranks sharing 2 cores, ``algorithm="recursive_doubling"`` at 4 KiB took
  89 us against 62 us for ``auto``, which ran the same rounds.
  Its plan is prepared once per size, dtype, op, check and name (``_Hot``, an
  ``algorithms._planned.Prepared`` over the transport's ``plan_runner``):
  the pick, the plan, the descriptor, the links and their seq offsets. A
  call then computes its descriptor tag, writes the rounds' tags and runs
  the compiled call; on 4 ranks sharing 2 cores that took the Python of a
  4 KiB call from about 25 to 14 us (docs/performance.md, "a plain call
  prepared once").

Both run through ``Executor.inline``: the same sequence numbers, stats,
trace and poisoning as ``Executor.submit``, without the general path's
per-call work (the buffer's view and write-back, the algorithm's extra
arguments, the job's closure). Anything else returns ``GENERAL``, and the
caller takes its general path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..algorithms._common import OPS, Workspace, check_op
from ..algorithms._planned import PLANNED, Prepared, lean_ok, prepared
from ..algorithms._window_plan import EXACT, PLAIN
from ..algorithms.direct import VARIANT_NAMES, hot_allreduce, hot_variant
from ..algorithms.halving_doubling import halving_doubling_allreduce
from ..algorithms.recursive_doubling import recursive_doubling_allreduce
from ..algorithms.ring import SEGMENT_BYTES, ring_allreduce
from ..transport.base import Transport
from .buffers import HOT_DTYPES

__all__ = ["GENERAL", "fast_allreduce", "stepped"]

#: ``fast_allreduce``'s answer for a call it does not take.
GENERAL: Any = object()

#: The stepped algorithms by name: the general path's operation name (``f"{algo} allreduce"``) and the function.
_STEPPED: dict[str, tuple[str, Any]] = {
    "recursive_doubling": ("recursive_doubling allreduce", recursive_doubling_allreduce),
    "halving_doubling": ("halving_doubling allreduce", halving_doubling_allreduce),
    "ring": ("ring allreduce", ring_allreduce),
}
_RD_OPS = ("mean", "sum")
_KEEP = 64  # the planned calls a group keeps (sizes, dtypes, ops); more clears them


def stepped(transport: Transport) -> bool:
    """Whether ``transport``'s group can take the stepped fast path (a size > 1, the transport's compiled step)."""
    return transport.size > 1 and hasattr(transport, "exchange_reduce")


def fast_allreduce(pg: Any, buf: Any, op: str, algorithm: str, check_finite: bool, async_op: bool,
                   timeout: float | None, wire_dtype: str | None, deterministic: bool) -> Any:
    """``pg.allreduce``'s result by a fast path (see the module docstring), or ``GENERAL``."""
    if type(buf) is not np.ndarray or async_op or (algorithm != "auto" and algorithm not in _STEPPED) \
            or buf.dtype not in HOT_DTYPES or not buf.flags.c_contiguous or not buf.flags.writeable:
        return GENERAL
    limit = pg.timeout if timeout is None else timeout
    if pg._hot:  # one host: what "auto" picks, in fewer steps; a bad op raises here, not inside the collective
        if algorithm != "auto":
            return GENERAL
        if not (wire_dtype or deterministic):
            variant: int | None = PLAIN
        elif wire_dtype is None and op in _RD_OPS:  # deterministic, mean or sum: hot_variant's answer, sooner
            variant = EXACT
        else:
            variant = hot_variant(buf.dtype, op, deterministic, wire_dtype)
        if variant is None:
            return GENERAL
        return pg._exec.inline(VARIANT_NAMES[variant], hot_allreduce, (
            pg.transport, buf, op if op in OPS else check_op(op), check_finite, limit, pg._ws, pg.kernel_backend,
            variant), buf.nbytes)
    if pg._stepped and op in _RD_OPS and not (wire_dtype or deterministic):
        key = (buf.nbytes, buf.dtype, op, bool(check_finite), algorithm)
        hot = pg._lean.get(key)
        if hot is None:
            if len(pg._lean) >= _KEEP:
                pg._lean.clear()
            hot = pg._lean[key] = _prepare(pg, buf, op, bool(check_finite), algorithm)
        if hot:
            return pg._exec.inline(hot.name, hot, (buf, limit), buf.nbytes)
        algo = pg._pick(algorithm, buf.nbytes)
        n = pg.transport.size
        if algo in _STEPPED and (not n & (n - 1) if algo != "ring" else pg.segment_bytes == SEGMENT_BYTES):
            name, fn = _STEPPED[algo]
            return pg._exec.inline(name, _rd, (fn, pg.transport, buf, op, check_finite, limit, pg._ws,
                                              pg.kernel_backend), buf.nbytes)
    return GENERAL


class _Hot:
    """A plain call's planned allreduce (``_planned.Prepared``: recursive doubling, halving-doubling or the ring
    that ``auto`` picks for its size), kept per size, dtype, op and check; where the transport declines it before
    a byte moves, the algorithm's own function runs it."""

    __slots__ = ("name", "run", "fn", "t", "op", "check", "ws", "backend")

    def __init__(self, name: str, run: Prepared, fn: Any, pg: Any, op: str, check: bool) -> None:
        self.name, self.run, self.fn, self.t, self.op, self.check = name, run, fn, pg.transport, op, check
        self.ws, self.backend = pg._ws, pg.kernel_backend

    def __call__(self, seq: int, buf: np.ndarray, limit: float) -> np.ndarray:
        if not self.run(seq, buf, limit, self.ws):
            self.fn(self.t, buf, op=self.op, check_finite=self.check, seq=seq, timeout=limit, workspace=self.ws,
                    backend=self.backend)
        return buf


def _prepare(pg: Any, buf: np.ndarray, op: str, check: bool, algorithm: str) -> _Hot | bool:
    """The ``_Hot`` call of ``buf``'s size, dtype and op on ``pg`` by ``algorithm`` (``"auto"``'s pick or a stepped
    algorithm's name), or False where that algorithm has no plan."""
    algo = pg._pick(algorithm, buf.nbytes)
    t = pg.transport
    if algo not in _STEPPED or algo not in PLANNED or getattr(t, "plan_runner", None) is None \
            or pg.kernel_backend not in (None, "cython") or (algo == "ring" and pg.segment_bytes != SEGMENT_BYTES):
        return False
    sched, rest = PLANNED[algo]
    if not lean_ok(t, buf, sched.any_size):
        return False
    name, fn = _STEPPED[algo]
    return _Hot(name, prepared(t, sched, rest, buf.size, buf.dtype, op, check), fn, pg, op, check)


def _rd(seq: int, fn: Any, transport: Transport, buf: np.ndarray, op: str, check_finite: bool, timeout: float,
        workspace: Workspace, backend: str | None) -> np.ndarray:
    """``fn`` (a stepped allreduce) on ``buf`` as sequence number ``seq``."""
    out: np.ndarray = fn(transport, buf, op=op, check_finite=check_finite, seq=seq, timeout=timeout,
                         workspace=workspace, backend=backend)
    return out
