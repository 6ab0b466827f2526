"""The engine of ``_window_plan`` in Python: the steps of ``_direct_c.Plan``, for where it was not built.

It follows ``_direct_c`` step for step (the same counters, ticks, ring
buffers, descriptors and reports, so the two describe one protocol) with
the kernels of ``gradcoll.kernels`` in place of the compiled loops, and the
``Window`` methods in place of the compiled waits. It is also what runs when
a caller pins a kernel backend (``backend=``) other than ``cython``.
"""

from __future__ import annotations

import struct
import time

import numpy as np

from .. import kernels
from ..errors import CollectiveTimeout, TransportBroken, TransportClosed
from ..kernels import lowp_reference
from ..transport.base import Window, WindowAlarm
from ._window_plan import BCAST, BF16, EXACT, FP16, GATHER, OPS, Shape

__all__ = ["PyPlan", "ARRIVED", "REDUCED", "DONE", "FILLED", "S_DONE", "S_MORE", "S_MISMATCH", "S_NONFINITE"]

ARRIVED, REDUCED, DONE, FILLED = 0, 1, 2, 3
S_DONE, S_MORE, S_MISMATCH, S_NONFINITE = 0, 16, 17, 18
_MARK = struct.Struct("<Q")


class _Stop(Exception):
    """A wait that ended otherwise than with the counters there: ``code`` (the window's) and ``culprit``."""

    def __init__(self, code: int, culprit: int) -> None:
        super().__init__(code, culprit)
        self.code, self.culprit = code, culprit


class PyPlan:
    """One call shape's engine in Python (the interface of ``_direct_c.Plan``)."""

    def __init__(self, shape: Shape, win: Window, desc: bytes, check: bool, divisor: float,
                 backend: str | None) -> None:
        self.s, self.w, self.desc, self.check, self.divisor, self.backend = shape, win, desc, check, divisor, backend
        self.pieces = shape.npieces
        self.waited = 0.0
        self.fmt = {BF16: "bf16", FP16: "fp16"}.get(shape.variant, "")
        self.encode = bool(self.fmt) and shape.item == 4  # else the buffer holds wire bits already
        self.wdtype = np.dtype(np.uint16) if self.fmt else shape.dtype
        self.buf: np.ndarray = np.empty(0)
        self.out: np.ndarray | None = None
        self.t0 = self.k = self.kin = self.phase = 0
        self.deadline = 0.0
        self.d = desc
        self.waiting = (0, 0)

    def start(self, buf: np.ndarray, out: np.ndarray | None, t0: int, seq: int, deadline: float) -> None:
        """Bind ``buf`` (and ``out`` for a gather), the first tick and the sequence number."""
        self.buf = buf.reshape(-1)
        self.out = None if out is None else out.reshape(-1).view(np.uint8)
        self.t0, self.k, self.kin, self.deadline = t0, 0, 0, deadline
        d = bytearray(self.desc)
        struct.pack_into("<q", d, 20, seq)
        self.d = bytes(d)

    def run(self, limit: int) -> tuple[int, int, int, int]:
        """Advance at most ``limit`` pieces: ``(status, culprit, piece, phase)``."""
        try:
            st, culprit = self._run(min(self.k + limit, self.pieces))
        except _Stop as stop:
            st, culprit = stop.code, stop.culprit
        return st, culprit, self.k, self.phase

    # -- waiting ----------------------------------------------------------------------------------
    def _wait(self, index: int, value: int) -> None:
        self.waiting = (index, value)
        t0 = time.perf_counter()
        w = self.w
        try:
            w.wait(range(w.size), index, value, max(0.0, self.deadline - time.monotonic()))
        except WindowAlarm as e:
            raise _Stop(4, int(e.peer or 0)) from None
        except CollectiveTimeout as e:
            raise _Stop(1, (e.missing or [0])[0]) from None
        except TransportBroken as e:
            raise _Stop(2, int(e.peer or 0)) from None
        except TransportClosed as e:
            raise _Stop(5 if e.peer == w.rank else 3, int(e.peer or 0)) from None
        finally:
            self.waited += time.perf_counter() - t0

    def _wait_done(self, t: int) -> None:
        if t + 1 > self.s.depth:
            self._wait(DONE, t + 1 - self.s.depth)

    # -- the steps --------------------------------------------------------------------------------
    def _typed(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(self.wdtype)

    def _copy_in(self, k: int) -> None:
        s, w, me = self.s, self.w, self.w.rank
        t = self.t0 + k
        self._wait_done(t)
        if s.region is None and (s.op != BCAST or s.root == me):
            for q in range(s.n if s.two else 1):
                a, b = s.share(k, q)
                if b > a:
                    dst = s.data(w, me, self.t0, k, q)
                    if self.encode:
                        kernels.encode_wire(self.buf[a:b], dst.view(np.uint16), self.fmt, check_finite=False)
                    else:
                        dst[:] = self.buf[a:b].view(np.uint8)
        if k == 0:
            w.describe(self.t0, self.d)
        w.publish(ARRIVED, self.t0 + (self.pieces if s.region is not None else k + 1))

    def _reduce(self, k: int, q: int, out: np.ndarray, dec: np.ndarray | None) -> bool:
        """Reduce share ``q`` of piece ``k`` from every slot into ``out`` (the wire bits, or values); False if not finite."""
        s = self.s
        rows = [self._typed(s.data(self.w, r, self.t0, k, q)) for r in range(s.n)]
        if self.fmt:
            acc = np.empty(len(rows[0]), np.float32)
            tmp = np.empty_like(acc)
            kernels.decode_wire(rows[0], acc, self.fmt)
            for x in rows[1:]:
                kernels.decode_wire(x, tmp, self.fmt)
                acc += tmp
            if s.op == OPS["mean"]:
                acc /= np.float32(self.divisor)
            with np.errstate(over="ignore", invalid="ignore"):
                kernels.encode_wire(acc, out, self.fmt, check_finite=False)
            if dec is not None:
                kernels.decode_wire(out, dec, self.fmt)
            return not self.check or lowp_reference.wire_finite(out, self.fmt)
        if s.variant == EXACT:
            bad = kernels.exact_reduce(rows[0], np.stack(rows[1:]), out, self.divisor, self.backend)
            return not self.check or bad < 0
        with np.errstate(over="ignore", invalid="ignore"):
            if s.op in (OPS["mean"], OPS["sum"]):
                kernels.mean_reduce(rows, out=out, op="mean" if s.op == OPS["mean"] else "sum", check_finite=False,
                                    backend=self.backend)
            else:  # an infinity the max (min) leaves out still halts: every input is checked
                ufunc = np.maximum if s.op == OPS["max"] else np.minimum
                np.copyto(out, rows[0])
                for x in rows[1:]:
                    ufunc(out, x, out=out)
                if self.check and not all(np.isfinite(x).all() for x in rows):
                    return False
        return not self.check or bool(np.isfinite(out).all())

    def _move(self, k: int) -> None:
        s, w, me = self.s, self.w, self.w.rank
        a, b = s.share(k, 0)
        if b <= a:
            return
        raw = self.buf.view(np.uint8)
        if s.op == BCAST:
            if s.root != me:
                raw[a:b] = s.data(w, s.root, self.t0, k, 0)
            return
        assert self.out is not None
        for r in range(s.n):
            self.out[r * s.count + a: r * s.count + b] = s.data(w, r, self.t0, k, 0)

    def _run(self, stop: int) -> tuple[int, int]:
        s, w, me, n = self.s, self.w, self.w.rank, self.w.size
        while self.k < stop:
            k = self.k
            t = self.t0 + k
            self.phase = 1
            if s.region is not None:
                if k == 0 and self.kin == 0:
                    self._copy_in(0)
                    self.kin = self.pieces
                self._wait_done(t)
            else:
                while self.kin <= k + 1 and self.kin < self.pieces:
                    self._copy_in(self.kin)
                    self.kin += 1
            self._wait(ARRIVED, t + 1)
            if k == 0:
                for r in range(n):
                    if w.descriptor(r, self.t0) != self.d:
                        return S_MISMATCH, r
            self.phase = 2
            if s.op >= GATHER:
                self._move(k)
                w.publish(DONE, t + 1)
                self.k += 1
                continue
            if not s.two:
                a, b = s.share(k, 0)
                dec = self.buf[a:b] if self.encode else None
                out = np.empty(b - a, np.uint16) if self.encode else self.buf[a:b].view(self.wdtype)
                if not self._reduce(k, 0, out, dec):
                    return S_NONFINITE, -1
                w.publish(DONE, t + 1)
                self.k += 1
                continue
            a, b = s.share(k, me)
            if b > a and not self._reduce(k, me, self._typed(s.result(w, me, self.t0, k))[: b - a], None):
                w.report(me)[:8] = np.frombuffer(_MARK.pack(t + 1), np.uint8)
            w.publish(REDUCED, t + 1)
            self.phase = 3
            self._wait(REDUCED, t + 1)
            for q in range(n):
                if _MARK.unpack(w.report(q)[:8].tobytes())[0] == t + 1:
                    w.publish(FILLED, t + 1)  # the piece is whole in this rank's slot (the compiled engine's cue)
                    return S_NONFINITE, q
            for q in range(n):
                a, b = s.share(k, q)
                if b > a and (not s.scatter or q == me):
                    res = self._typed(s.result(w, q, self.t0, k))[: b - a]
                    if self.encode:
                        kernels.decode_wire(res, self.buf[a:b], self.fmt)
                    else:
                        self.buf[a:b] = res
            w.publish(DONE, t + 1)
            self.k += 1
        if self.k < self.pieces:
            return S_MORE, -1
        self.phase = 3
        if s.region is not None:
            self._wait(DONE, self.t0 + self.pieces)
        return S_DONE, -1

    def __repr__(self) -> str:
        return f"<PyPlan {self.s.npieces} pieces>"
