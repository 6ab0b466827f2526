"""The prepared allreduce: everything a repeated call needs, decided and built once.

``prepare_allreduce`` takes one call's shape (element count, dtype, op,
check) and choices (algorithm, ``wire_dtype``, ``deterministic``) on one
group, checks them all, and returns an ``Allreduce``: its ``run(seq, buf,
timeout)`` is the whole call. A group keeps one per shape and choices
(``gradcoll.group.ProcessGroup``), in the manner of gloo's algorithm objects:
set up in the constructor, a short ``run``.

Preparing decides, in one place and once:

* **Whether the call can run.** An unknown op, algorithm or wire format, a
  dtype the variant does not take, a schedule the group cannot run (the
  direct allreduce without shared memory): ``UsageError`` here, on every
  rank alike, before anything is sent; the group stays usable.
* **The schedule.** ``auto``'s pick (``select_allreduce``) never names one
  that cannot run the call: where the variant has no shared-window form it
  picks among the others.
* **The variant.** Plain (partial sums), low-precision wire, deterministic,
  or both of the last two, and ``max``/``min`` under ``deterministic`` run
  plain (they are exact in any order): every schedule takes every variant
  (``gradcoll.algorithms.rows``).
* **The route**, the one answer to "can this call go compiled?":
  ``window``, the shared window's engine in one C call
  (``direct.WindowCall``); ``rounds``, every round in one call of the
  transport's compiled rounds (``Transport.rounds``; ``_planned.Prepared``),
  with the schedule's guarded form for what that call declines; ``guarded``,
  the schedule's (or variant's) function in the guard's frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..errors import UsageError
from ..transport.base import Transport
from . import select_allreduce
from ._common import REDUCE_DTYPES, Workspace, check_op
from ._planned import PLANNED, Guarded, Prepared, compiled_ok
from ._window_plan import BF16, EXACT, FP16, PLAIN
from .deterministic import EXACT_DTYPES, deterministic_allreduce
from .direct import VARIANT_NAMES, WindowCall
from .low_precision import wire_allreduce, wire_of
from .registry import schedule
from .ring import SEGMENT_BYTES

__all__ = ["Allreduce", "Group", "prepare_allreduce", "ROUTES"]

#: The routes a prepared call takes (``Allreduce.route``).
ROUTES = ("window", "rounds", "guarded")

#: The window engine's variants, by (deterministic, wire).
_WINDOW = {(False, None): PLAIN, (True, None): EXACT, (False, "bf16"): BF16, (False, "fp16"): FP16}
#: The dtypes the window engine and the compiled rounds take as they are.
_NATIVE = (np.dtype(np.float32), np.dtype(np.float64))


class Group(NamedTuple):
    """What preparing needs to know of a group: its transport and options, its hosts (``layout``, ranks per host;
    None: not known), and ``two_level(nbytes)``, the transport and arguments its two-level schedule runs with."""

    transport: Transport
    segment_bytes: int
    backend: str | None
    workspace: Workspace
    layout: tuple[int, ...] | None
    two_level: Callable[[int], tuple[Transport, dict[str, Any]]]


class Allreduce:
    """One prepared allreduce (see the module docstring): ``run(seq, buf, timeout)`` returns ``buf``.

    ``name`` is what the group's records and errors call it, ``algorithm``
    the schedule it runs, ``route`` how (``ROUTES``).
    """

    __slots__ = ("name", "algorithm", "route", "run")

    def __init__(self, name: str, algorithm: str, route: str, run: Callable[[int, np.ndarray, float], Any]) -> None:
        self.name, self.algorithm, self.route, self.run = name, algorithm, route, run

    def __repr__(self) -> str:
        return f"<Allreduce {self.name!r} route={self.route}>"


def prepare_allreduce(g: Group, count: int, dtype: np.dtype, op: str, algorithm: str = "auto",
                      check_finite: bool = True, wire_dtype: str | None = None,
                      deterministic: bool = False) -> Allreduce:
    """The prepared allreduce of ``count`` elements of ``dtype`` on ``g`` (UsageError if it cannot run)."""
    t, check = g.transport, bool(check_finite)
    check_op(op)
    fmt = wire_of(np.empty(0, dtype), wire_dtype)
    if fmt is not None and op not in ("mean", "sum") and dtype != np.float32 and dtype.name != "bfloat16":
        fmt = None  # a float16 buffer's max or min: exact in float16, the plain form (as before any wire)
    if fmt is None and dtype not in REDUCE_DTYPES:
        raise UsageError(f"buf has dtype {dtype}; reductions take float16, float32 or float64")
    exact = deterministic and op in ("mean", "sum")  # max and min are exact in any order
    if exact and fmt is None and dtype not in EXACT_DTYPES:
        raise UsageError("deterministic=True takes float32 or float64 buffers (float16 and bfloat16 through "
                         f"their wire format), got {dtype}")
    variant = _WINDOW.get((exact, fmt))
    windowed = variant is not None and (variant == PLAIN or op in ("mean", "sum"))
    nbytes = count * dtype.itemsize
    algo = _pick(g, algorithm, nbytes, windowed)
    if algo == "direct" and not windowed:
        raise UsageError(f"rank {t.rank}: the direct allreduce has no form for op {op!r} with "
                         f"wire_dtype={wire_dtype!r}, deterministic={deterministic}; use another algorithm "
                         "(auto picks one)")
    if algo == "two_level":
        transport, extra = g.two_level(nbytes)
    else:
        transport, extra = t, ({"segment_bytes": g.segment_bytes} if algo == "ring" else {})
    ws, backend = g.workspace, g.backend
    if algo == "direct" and variant is not None and dtype in _NATIVE and t.size > 1 \
            and (variant in (PLAIN, EXACT) or dtype == np.float32):
        return _window(t, algo, op, check, variant, ws, backend)
    if fmt is not None or exact:
        return _variant(transport, extra, algo, op, check, fmt, exact, ws, backend, g.segment_bytes)
    compiled = PLANNED.get(algo)
    fn = schedule(algo).allreduce
    if compiled is not None and op in ("mean", "sum") and dtype in _NATIVE and backend in (None, "cython") \
            and (algo != "ring" or g.segment_bytes == SEGMENT_BYTES) \
            and compiled_ok(t, np.empty(0, dtype), compiled[0].any_size):
        plan = Prepared(t, compiled[0], compiled[1], count, dtype, op, check)  # owned here: no other cache
        return _rounds(plan, compiled[2], t, op, check, ws, backend, f"{algo} allreduce")

    def run(seq: int, buf: np.ndarray, limit: float) -> np.ndarray:
        fn(transport, buf, op=op, check_finite=check, seq=seq, timeout=limit, workspace=ws, backend=backend, **extra)
        return buf

    return Allreduce(f"{algo} allreduce", algo, "guarded", run)


def _pick(g: Group, algorithm: str, nbytes: int, windowed: bool) -> str:
    t = g.transport
    if algorithm == "auto":
        return select_allreduce(nbytes, t.size, t.name, t.shared_memory and windowed, layout=g.layout)
    if schedule(algorithm).needs == "window" and not t.shared_memory and t.size > 1:
        raise UsageError(f"rank {t.rank}: the {algorithm} allreduce needs ranks that share memory (shm, inproc; "
                         f"mpi on one node); the {t.name} transport does not")
    return algorithm


def _window(t: Transport, algo: str, op: str, check: bool, variant: int, ws: Workspace,
            backend: str | None) -> Allreduce:
    return Allreduce(VARIANT_NAMES[variant], algo, "window", WindowCall(t, op, check, ws, backend, variant))


def _rounds(plan: Prepared, guarded: Guarded, t: Transport, op: str, check: bool, ws: Workspace,
            backend: str | None, name: str) -> Allreduce:
    def run(seq: int, buf: np.ndarray, limit: float) -> np.ndarray:
        if not plan(seq, buf, limit, ws):  # declined before a byte moved: the schedule in the guard's frame
            guarded(t, buf, op, check, seq, limit, ws, backend)
        return buf

    return Allreduce(name, plan.sched.algo, "rounds", run)


def _variant(t: Transport, extra: dict[str, Any], algo: str, op: str, check: bool, fmt: str | None, exact: bool,
             ws: Workspace, backend: str | None, segment_bytes: int) -> Allreduce:
    kw = {k: v for k, v in extra.items() if k != "cross"}
    kw.setdefault("segment_bytes", segment_bytes)
    fn: Callable[..., Any] = deterministic_allreduce
    name = f"deterministic {algo} allreduce"
    if fmt is not None:
        fn, name = wire_allreduce, f"{algo} allreduce ({fmt} wire{', deterministic' if exact else ''})"
        kw.update(wire=fmt, exact=exact)

    def run(seq: int, buf: np.ndarray, limit: float) -> np.ndarray:
        fn(t, buf, algorithm=algo, op=op, check_finite=check, seq=seq, timeout=limit, workspace=ws, backend=backend,
           **kw)
        return buf

    return Allreduce(name, algo, "guarded", run)
