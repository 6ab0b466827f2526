"""Direct allreduce: on one host, every rank reads every rank's slot of a shared window.

The ranks share one window (``Transport.group_window``: shm, inproc, mpi
on one node). Each rank owns a slot of it; no byte goes through a per-pair
message ring. Two schedules (``mode``), the same bits either way:

* **one-shot** (small buffers): each rank copies its buffer into its slot
  and publishes; once every rank has, each reduces the whole buffer from all
  ``n`` slots in one pass, in rank order 0..n-1 (the fused n-input sum and
  finite check), straight into its own buffer, and says it is done.
* **two-shot** (large buffers): the buffer is cut into ``n`` chunks; each
  rank copies its buffer in, reduces its own chunk from all ``n`` slots into
  its result area and publishes it; every rank then copies every chunk's
  result out. Each rank reads ``S`` and writes ``S / n`` in the reduction
  instead of reading ``n S``.

Both stream: a buffer larger than a piece goes in pieces (``PIECE_BYTES``
one-shot, ``SEG_BYTES`` per chunk two-shot) through a ring of ``DEPTH``
buffers in each slot, so that while one rank reduces piece ``k``, another
copies in piece ``k + 1``, and the pieces stay in cache. Every sum is in rank
order, so every rank gets the same bits whatever the arrival order: those of
``mean_reduce`` over the ranks' buffers (the star's).

Whole collectives run in one compiled call each (``_direct_c``, no Python
between the steps); without the extension, the same steps run in Python
(``_window_py``). Variants: ``deterministic=True`` reduces with the exact
kernel (``exact_reduce``'s bits), ``wire_dtype`` puts bf16/fp16 into the
slots and sums in float32. A buffer from ``ProcessGroup.alloc`` already lives
in a slot: nothing is copied in. Errors: see ``_window_run``. The choice
between the schedules is the cost model's (``gradcoll.model.costmodel``,
``direct_modes``). See docs/algorithms/direct.md.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Hashable
from typing import Any, cast

import numpy as np

from ..errors import UsageError
from ..model.window_model import direct_one_shot_bytes
from ..transport.base import Transport, Window
from ._common import Options, Workspace, as_flat, check_op
from ._guard import guarded_allreduce
from ._window_plan import BF16, EXACT, FP16, OPS, PLAIN, describe, shape
from ._window_run import failed, group_window, run, state

__all__ = ["direct_allreduce", "WindowCall", "variant_name", "VARIANT_NAMES", "direct_exact",
           "direct_wire", "alloc", "one_shot_limit", "PIECE_BYTES", "SEG_BYTES"]

#: One-shot: bytes per piece; two-shot: bytes per chunk per piece (pieces that stay in a core's cache).
PIECE_BYTES = 256 << 10
SEG_BYTES = 128 << 10
#: The deterministic reduction of 3 or more ranks is bound by its kernel's instructions: in smaller segments
#: the copies of one overlap the reduction of another.
EXACT_SEG_BYTES = 32 << 10
_MODES = (None, "one-shot", "two-shot")


#: The bf16/fp16 variants, and the deterministic one of 3 or more ranks, run one-shot up to at most this many
#: bytes of the caller's buffer per rank. Their reductions (the exact kernel; the rounding of every sum to the
#: wire and back) are several times a plain one's work per element, and one-shot has every rank run them on the
#: whole buffer, so two-shot wins from a few KiB on (docs/algorithms/direct.md, "Schedules").
HEAVY_ONE_SHOT_BYTES_PER_RANK = 1 << 10


@functools.lru_cache(maxsize=256)
def one_shot_limit(n: int, variant: int = PLAIN) -> int:
    """The largest buffer (bytes) that runs one-shot on ``n`` ranks: where the cost model's two-shot wins; for
    the wire variants, and the deterministic one of 3 or more ranks, at most ``HEAVY_ONE_SHOT_BYTES_PER_RANK``
    per rank."""
    limit = direct_one_shot_bytes(n)
    heavy = variant in (BF16, FP16) or (variant == EXACT and n > 2)  # two ranks' exact sum is the plain loop
    return min(limit, n * HEAVY_ONE_SHOT_BYTES_PER_RANK) if heavy else limit


def direct_allreduce(transport: Transport, buf: np.ndarray, *, op: str = "mean", check_finite: bool = True,
                     seq: int = 0, timeout: float | None = None, workspace: Workspace | None = None,
                     backend: str | None = None, mode: str | None = None) -> np.ndarray:
    """Allreduce ``buf`` in place through the group's shared window; returns ``buf``.

    ``mode``: ``"one-shot"``, ``"two-shot"`` or None (the cost model's choice
    by size). ``backend``: a kernel backend other than ``cython`` runs the
    Python steps with that backend's kernels.
    """
    if isinstance(buf, np.ndarray) and buf.dtype == np.float16:
        # The window's 16-bit variants carry wire values, not float16 data: float16 runs widened to float32
        # (max and min exactly; sums and means rounded once, as the fp16 wire path does).
        wide = as_flat(buf, reduce=True).astype(np.float32)
        direct_allreduce(transport, wide, op=op, check_finite=check_finite, seq=seq, timeout=timeout,
                         workspace=workspace, backend=backend, mode=mode)
        np.copyto(buf.reshape(-1), wide, casting="unsafe")
        return buf
    if mode is None and backend in (None, "cython") and _engine_call(transport, buf, op, check_finite, seq, timeout, PLAIN):
        return buf
    flat = as_flat(buf, reduce=True)
    check_op(op)
    _allreduce(transport, buf, flat, op, check_finite, seq, timeout, backend, PLAIN, mode)
    return buf


class WindowCall:
    """The direct allreduce of one op, check and variant (``PLAIN``, ``EXACT``, ``BF16`` or ``FP16``) of plain C-contiguous float32/float64
    arrays, prepared for repeated calls (a prepared allreduce's ``window`` route): ``call(seq, buf, timeout)``
    goes straight into the window's compiled engine once it has one, and builds it (the guarded steps) where it
    has not."""

    __slots__ = ("t", "op", "code", "check", "ws", "backend", "variant", "name", "runner")

    def __init__(self, transport: Transport, op: str, check_finite: bool, workspace: Workspace | None,
                 backend: str | None, variant: int = PLAIN) -> None:
        self.t, self.op, self.code, self.check, self.ws = transport, op, OPS[op], check_finite, workspace
        self.backend, self.variant, self.name = backend, variant, _name(variant)
        self.runner: Any = None  # the window's compiled engine, once it has one

    def __call__(self, seq: int, buf: np.ndarray, timeout: float) -> np.ndarray:
        runner = self.runner
        if runner is None and self.backend in (None, "cython") and self.t.shared_window is not None:
            runner = self.t.shared_window.cache.get("window-run")
            if runner is not None and hasattr(runner, "fast"):
                self.runner = runner
            else:
                runner = None
        if runner is not None:
            started = time.monotonic()
            how = runner.allreduce(buf, self.code, self.check, seq, timeout, self.variant)
            if how is None:
                return buf
            if how is not NotImplemented:
                failed(self.t, cast(Window, self.t.shared_window), self.name, seq, timeout, buf, how, started)
        t, op, check, variant = self.t, self.op, self.check, self.variant
        if variant == EXACT:
            return direct_exact(t, buf, op=op, check_finite=check, seq=seq, timeout=timeout, backend=self.backend)
        if variant != PLAIN:
            return direct_wire(t, buf, wire="bf16" if variant == BF16 else "fp16", op=op, check_finite=check,
                               seq=seq, timeout=timeout, backend=self.backend)
        return direct_allreduce(t, buf, op=op, check_finite=check, seq=seq, timeout=timeout, workspace=self.ws,
                                backend=self.backend)


def direct_exact(transport: Transport, buf: np.ndarray, *, op: str, check_finite: bool, seq: int,
                 timeout: float | None, backend: str | None = None, mode: str | None = None) -> np.ndarray:
    """The deterministic allreduce on the window (``deterministic_allreduce(algorithm="direct")``)."""
    if mode is None and backend in (None, "cython") and _engine_call(transport, buf, op, check_finite, seq, timeout, EXACT):
        return buf
    _allreduce(transport, buf, buf.reshape(-1), op, check_finite, seq, timeout, backend, EXACT, mode)
    return buf


def direct_wire(transport: Transport, buf: np.ndarray, *, wire: str, op: str, check_finite: bool, seq: int,
                timeout: float | None, backend: str | None = None, mode: str | None = None) -> np.ndarray:
    """The bf16/fp16 allreduce on the window (``wire_allreduce(algorithm="direct")``).

    ``buf`` is float32 (encoded on its way into the slot, decoded on its way
    out) or 16-bit wire values already (copied as they are).
    """
    variant = BF16 if wire == "bf16" else FP16
    if mode is None and backend in (None, "cython") and _engine_call(transport, buf, op, check_finite, seq, timeout, variant):
        return buf
    flat = buf.reshape(-1)
    if flat.dtype != np.float32:
        flat = flat.view(np.uint16)
    _allreduce(transport, buf, flat, op, check_finite, seq, timeout, backend,
               variant, mode)
    return buf


def _engine_call(t: Transport, buf: np.ndarray, op: str, check: bool, seq: int, timeout: float | None, variant: int) -> bool:
    """The engine's path: the whole call in one C call (``Runner.allreduce``) once its engine exists; True if it ran.

    It declines (False) what it has no engine for yet (the first call of a
    size, op and variant, a region, another dtype): ``_allreduce`` builds it.
    """
    win = t.shared_window
    runner = None if win is None else win.cache.get("window-run")
    code = OPS.get(op)
    if win is None or runner is None or code is None or not hasattr(runner, "fast"):
        return False
    limit = t.timeout if timeout is None else timeout
    started = time.monotonic()
    how = runner.allreduce(buf, code, check, seq, limit, variant)
    if how is None:
        return True
    if how is not NotImplemented:
        failed(t, win, "direct allreduce" if variant == PLAIN else _name(variant), seq, limit, buf, how, started)
    return False


def _allreduce(t: Transport, buf: np.ndarray, flat: np.ndarray, op: str, check: bool, seq: int,
               timeout: float | None, backend: str | None, variant: int, mode: str | None) -> None:
    wire = {BF16: "bf16", FP16: "fp16"}.get(variant)
    name = _name(variant)
    if mode not in _MODES:
        raise UsageError(f"mode must be 'one-shot', 'two-shot' or None, got {mode!r}")
    if t.size == 1:  # nothing to share: the frame's own finite check is the whole collective
        guarded_allreduce(t, buf, Options(op, check, seq, timeout, None, backend), name=name, algo="direct",
                          body=lambda *_: None, flat=flat)
        return
    win = group_window(t, timeout, name, seq, flat.nbytes)
    region = None if wire else _region(win, flat)
    n = t.size
    # the cost model's choice, unless GRADCOLL_DIRECT_MODE names one (read as the engine is built; such an engine
    # still serves the engine's path, as the model's would)
    chosen = mode if mode is not None else forced_mode()
    two = region is not None or chosen == "two-shot" or (
        chosen is None and flat.nbytes > one_shot_limit(n, variant))
    rid = (-1, 0) if region is None else (region[2], region[1])
    key = (flat.size, flat.dtype.char, op, variant, check, two, rid)

    def build() -> tuple[Any, bytes]:
        shp = shape(n, flat.size, flat.dtype, win.slot_bytes, two=two, op=OPS[op], variant=variant,
                    piece_bytes=PIECE_BYTES, seg_bytes=EXACT_SEG_BYTES if variant == EXACT and n > 2 else SEG_BYTES,
                    region=None if region is None else (region[0], region[1]))
        desc = describe("allreduce", op, flat.dtype, flat.size, seq, extra=(variant, int(check), int(two), *rid))
        return shp, desc

    fast: Hashable | None = None
    if mode is None and flat.dtype in _FAST_DTYPES and flat.flags.aligned and hasattr(state(t, win), "key"):
        fast = state(t, win).key(flat.size, _FAST_DTYPES[flat.dtype], OPS[op], check, variant)
        if region is not None:  # the engine of this region and offset (Runner.allreduce finds both)
            fast = (fast, region[2], region[1])
    run(t, win, key, build, flat, None, name=name, seq=seq, timeout=timeout, check=check, backend=backend,
        fast=fast)


def variant_name(variant: int) -> str:
    """The collective's name for a variant (what the group's records and the errors call it)."""
    return _name(variant)


def forced_mode() -> str | None:
    """``GRADCOLL_DIRECT_MODE`` (``one-shot`` or ``two-shot``): the schedule of every call whose engine is built
    from now on, instead of the cost model's choice by size (how ``benches/fit_costmodel.py`` measures each)."""
    mode = os.environ.get("GRADCOLL_DIRECT_MODE") or None
    if mode not in _MODES:
        raise UsageError(f"GRADCOLL_DIRECT_MODE must be 'one-shot' or 'two-shot', got {mode!r}")
    return mode


#: The collective's name for each variant (what the group's records and the errors call it).
VARIANT_NAMES = {PLAIN: "direct allreduce", EXACT: "deterministic direct allreduce",
                 BF16: "direct allreduce (bf16 wire)", FP16: "direct allreduce (fp16 wire)"}


def _name(variant: int) -> str:
    return VARIANT_NAMES[variant]


_FAST_DTYPES = {np.dtype(np.float32): 11, np.dtype(np.float64): 12}  # NumPy's type numbers


# -- zero copy: arrays that live in a slot --------------------------------------------------------------
def alloc(transport: Transport, shape_: int | tuple[int, ...], dtype: Any, timeout: float | None = None) -> np.ndarray:
    """Collective: a new array of ``shape_`` and ``dtype`` living in this rank's slot of a new window.

    Every rank calls it with the same shape and dtype, in the same order
    among its collectives. An allreduce (op mean/sum/max/min, plain or
    deterministic) of the array, or of a contiguous part of it at the same
    offset on every rank, reads it in place: nothing is copied in. It stays
    valid until the transport closes; it is zero-filled.
    """
    dt = np.dtype(dtype)
    dims = (shape_,) if isinstance(shape_, (int, np.integer)) else tuple(shape_)
    if any(int(d) < 0 for d in dims):
        raise UsageError(f"rank {transport.rank}: alloc shape {dims} has a negative dimension")
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    group = group_window(transport, timeout, "alloc")
    win = transport.window(max(nbytes, 64), timeout)
    if win is None:  # pragma: no cover - group_window above would have raised
        raise UsageError(f"rank {transport.rank}: the {transport.name} transport shares no memory")
    regions: list[Window] = group.cache.setdefault("regions", [])
    regions.append(win)
    lay = win.layout()
    start = lay.address + lay.slots + lay.rank * lay.stride
    st = state(transport, group)
    if hasattr(st, "add_region"):
        st.add_region(start, start + lay.slot_bytes)
    arr: np.ndarray = win.slot(win.rank)[:nbytes].view(dt).reshape(dims)
    return arr


def _region(group: Window, flat: np.ndarray) -> tuple[Window, int, int] | None:
    """``(window, offset, index)`` when ``flat`` lies in this rank's slot of an allocated window."""
    regions: list[Window] | None = group.cache.get("regions")
    if not regions or not flat.size:
        return None
    at = flat.__array_interface__["data"][0]
    for i, win in enumerate(regions):
        lay = win.layout()
        start = lay.address + lay.slots + lay.rank * lay.stride
        if start <= at and at + flat.nbytes <= start + lay.slot_bytes and not win.closed:
            return win, at - start, i
    return None
