"""Running a collective over the group's shared window, and its error path.

``run`` finds (or builds) the engine of the call's shape (``_window_plan``),
gives it the next ticks of the window, and drives it in batches of
``BATCH_BYTES`` of the buffer (between batches, the wait time goes to the
transport's accounting and the interpreter gets to handle signals). When the
engine stops short, ``fail`` makes every rank raise the same error, in the
terms of the one verdict table (``gradcoll.algorithms._verdict``):

* a **mismatch** (a descriptor that differs): every rank has read every
  rank's descriptor, so each builds the table from them directly (row 7, or
  row 11 when only what the record has no field for differs);
* a **non-finite** result: every rank has the same view of the piece where
  it appeared (the slots still hold it: nobody published ``done`` for it), so
  each scans it for the lowest rank holding a NaN/Inf and that rank's first
  such element (row 8), or finds none and reports the overflow (row 9);
* anything else (a timeout, a dead or closed peer, another rank's alarm):
  the window is the alarm channel. The rank writes its handshake record
  (what it met, on whose link) into its header and raises the alarm, which
  wakes every waiter of every rank; it then waits, until a grace period
  ends, for every other rank's record, or its death, or its close. A rank
  with no record is absent: TIMEOUT, or BROKEN when its process died, or
  CLOSED. The verdict of that table is every rank's error: a dead rank named
  by everyone, a rank that never arrived named as such.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NoReturn

import numpy as np

from ..errors import CollectiveMismatch, CollectiveTimeout, TransportBroken, TransportClosed, UsageError
from ..kernels import lowp_reference
from ..transport.base import Transport, Window
from ..transport.frame import FrameMismatch
from . import _witness
from ._alarm import _Exchange, experience
from ._common import Coll
from ._handshake import Record, pack, unpack, with_status
from ._verdict import ALARMS, BROKEN, CLOSED, NONFINITE, OK, PROTOCOL, verdict
from ._window_plan import BF16, FP16, Engine, Shape, records
from ._window_py import FILLED, S_MISMATCH, S_MORE, S_NONFINITE, PyPlan
from .tags import ALARM

__all__ = ["run", "group_window", "state", "BATCH_BYTES", "compiled"]

#: Bytes of the buffer each call into the engine covers before it returns to the interpreter.
BATCH_BYTES = 4 << 20
_MAX_PLANS = 64


def compiled() -> Any:
    """The compiled engines (``_direct_c``), or None when the extension was not built."""
    try:
        return importlib.import_module("gradcoll.algorithms._direct_c")
    except ImportError:
        return None


_COMPILED = compiled()


def group_window(t: Transport, timeout: float | None, what: str, seq: int = 0, nbytes: int = 0) -> Window:
    """The transport's group window, or a UsageError naming ``what`` needs one.

    The window is made at the first collective that needs it (collectively);
    a rank that does not arrive for that is named as in any collective.
    """
    win = t.shared_window
    if win is not None:
        return win
    try:
        win = t.group_window(timeout)
    except CollectiveTimeout as exc:
        coll = Coll(t, what, seq, nbytes, timeout)
        who = exc.missing or [-1]
        names = ", ".join(map(str, who))
        raise coll.timeout_error(who, f"rank(s) {names} stalled in {what}'s window set-up: they never arrived") from exc
    if win is None:
        raise UsageError(f"rank {t.rank}: {what} needs ranks that share memory (the shm or inproc transport, or mpi "
                         f"on one node); the {t.name} transport does not")
    return win


class _State:
    """Per group window: the next tick (the same on every rank) and the engines built so far.

    With the extension, ``_direct_c.Runner`` is the state (and the engine's path).
    """

    def __init__(self) -> None:
        self.tick = 0
        self.plans: dict[tuple[Any, ...], tuple[Shape, Engine, bytes]] = {}


def state(t: Transport, win: Window) -> Any:
    """The window's ``_State`` (a ``_direct_c.Runner`` where the extension is built)."""
    st = win.cache.get("window-run")
    if st is None:
        st = win.cache["window-run"] = _State() if _COMPILED is None else _COMPILED.Runner(t, BATCH_BYTES)
    return st


def run(t: Transport, win: Window, key: tuple[Any, ...], build: Callable[[], tuple[Shape, bytes]], buf: np.ndarray,
        out: np.ndarray | None, *, name: str, seq: int, timeout: float | None, check: bool,
        backend: str | None = None, fast: Hashable | None = None) -> None:
    """Run one collective on ``win``: the engine of ``key`` (made by ``build`` the first time) over ``buf``.

    ``fast``: the engine's key (``Runner.key``, with the region and offset
    for an allocated buffer) under which the compiled engine also goes.
    """
    st = state(t, win)
    entry = st.plans.get(key)
    if entry is None:
        shape, desc = build()
        use = _COMPILED if backend in (None, "cython") else None
        entry = (shape, shape.engine(win, desc, check, use, PyPlan), desc)
        if use is None:
            entry[1].backend = backend
        if len(st.plans) >= _MAX_PLANS:
            st.plans.clear()
            if use is not None:
                st.fast.clear()
        st.plans[key] = entry
        if fast is not None and use is not None:
            st.fast[fast] = entry
    shape, eng, desc = entry
    t0 = st.tick
    st.tick += eng.pieces
    limit = t.timeout if timeout is None else timeout
    started = time.monotonic()
    eng.start(buf, out, t0, seq, time.monotonic() + (1e9 if limit is None else limit))
    per = max(shape.seg * shape.n if shape.two else shape.piece, 1) * shape.witem
    batch = max(1, BATCH_BYTES // per)
    before = eng.waited
    while True:
        status, culprit, k, phase = eng.run(batch)
        t.note_wait(eng.waited - before)
        before = eng.waited
        if status != S_MORE:
            break
    if status:
        failed(t, win, name, seq, limit, buf, (status, culprit, k, phase, t0, entry), started)


def failed(t: Transport, win: Window, name: str, seq: int, limit: float | None, buf: np.ndarray,
           how: tuple[Any, ...], started: float) -> NoReturn:
    """``fail`` for an engine that stopped as ``how`` says: ``(status, culprit, piece, phase, t0, entry)``.

    ``started`` is when the call began (``time.monotonic()``): the error path's grace counts from it.
    """
    status, culprit, k, phase, t0, (shape, eng, desc) = how
    coll = Coll(t, name, seq, buf.nbytes, limit)
    coll.begin(3 if shape.two else 2)
    coll.started = started
    coll.step = phase
    coll.desc = unpack(desc, 1)[0]._replace(seq=seq).desc()
    fail(coll, win, shape, eng, t0, status, culprit, k, buf)


def fail(coll: Coll, win: Window, shape: Shape, eng: Engine, t0: int, status: int, culprit: int, k: int,
         buf: np.ndarray) -> NoReturn:
    """The error every rank raises after the engine stopped with ``status`` (see the module docstring).

    ``coll.desc`` is this rank's call (the descriptor fields of its record).
    """
    recs, same = records(win, t0) if status in (S_MISMATCH, S_NONFINITE) else ([], [])
    if status == S_MISMATCH:
        table = [r if ok else r._replace(status=PROTOCOL) for r, ok in zip(recs, same, strict=True)]
        win.alarm(bytes(pack([table[coll.rank]._replace(status=PROTOCOL)])))
        verdict(coll, table, ALARMS)
        raise CollectiveMismatch(f"rank {coll.rank}: during {coll.where()}: rank {culprit}'s call differs")
    if status == S_NONFINITE:
        _nonfinite(coll, win, shape, t0, k, buf, recs)
    index, value = eng.waiting
    me = coll.rank
    exc: BaseException | None
    if status == 1:
        missing = [r for r in range(coll.size) if r != me and win.counter(r, index) < value]
        exc = coll.timeout_error(missing or [culprit], f"rank(s) {', '.join(map(str, missing))} did not get there")
    elif status == 2:
        exc = coll.translate(TransportBroken(f"peer {culprit} died", rank=me, peer=culprit), culprit)
    elif status == 3:
        exc = coll.translate(TransportClosed(f"peer {culprit} closed", rank=me, peer=culprit), culprit)
    elif status == 5:
        raise TransportClosed(f"rank {me}: this rank's transport was closed during {coll.where()}", rank=me, peer=me)
    else:
        exc = None  # woken by another rank's alarm
    _alarms(coll, win, exc)


def _own(coll: Coll, exc: BaseException | None) -> Record:
    """The record of what this rank met (the allreduces' error path decides it)."""
    status, peer = ((OK, -1, 0.0), -1) if exc is None else experience(exc)
    return with_status(coll.desc, status, peer)


class _WindowExchange(_Exchange):
    """The allreduces' error-path exchange, with the window as one more channel.

    Records come through the window (a rank's alarm) as well as over the links
    and the witness channel, as the allreduces' error path sends them (a rank
    running a collective over the links instead, another algorithm, meets it
    there); a rank whose process died or whose window closed is settled by the
    window's own state.
    """

    def __init__(self, coll: Coll, own: Record, win: Window) -> None:
        super().__init__(coll, own)
        self.win = win

    def _read_board(self) -> None:
        super()._read_board()
        for r in range(self.n):
            if r == self.me or self.records[r] is not None:
                continue
            raw = self.win.alarm_record(r)
            if raw is not None:
                self.take(r, bytes(raw))
            elif (state := self.win.state(r)) in ("dead", "closed"):
                self.seen.setdefault(r, BROKEN if state == "dead" else CLOSED)


def _alarms(coll: Coll, win: Window, exc: BaseException | None) -> NoReturn:
    """Raise the alarm with this rank's record, collect everyone's until the grace, raise the verdict."""
    me, t = coll.rank, coll.t
    if win.closed or t.closed:
        raise exc or TransportClosed(f"rank {me}: this rank's transport was closed during {coll.where()}",
                                     rank=me, peer=me)
    own = _own(coll, exc)
    win.alarm(bytes(pack([own])))  # wakes every waiter of every rank
    _witness.failing(t)
    ex = _WindowExchange(coll, own, win)
    if isinstance(exc, FrameMismatch) and exc.tag == ALARM:
        ex.take(exc.peer, exc.payload)
    if coll.size > 1:
        ex.run()
    verdict(coll, ex.table(), ALARMS, own=exc)
    raise AssertionError("the verdict of a failed collective always raises")  # pragma: no cover


def _first_bad(x: np.ndarray, fmt: str | None) -> int:
    if fmt is not None:
        mask = lowp_reference.WIRES[fmt]
        hits = np.flatnonzero((x & mask) == mask)
    else:
        hits = np.flatnonzero(~np.isfinite(x))
    return int(hits[0]) if hits.size else -1


def _value(x: np.ndarray, i: int, fmt: str | None) -> float:
    if fmt is None:
        return float(x[i])
    out = np.empty(1, np.float32)
    lowp_reference.decode(x[i: i + 1], out, fmt)
    return float(out[0])


def _nonfinite(coll: Coll, win: Window, shape: Shape, t0: int, k: int, buf: np.ndarray,
               recs: list[Record]) -> NoReturn:
    """Every rank scans piece ``k`` in every slot (the same bytes on every rank) and raises the same error."""
    fmt = {BF16: "bf16", FP16: "fp16"}.get(shape.variant)
    wdt = np.dtype(np.uint16) if fmt else shape.dtype
    shares = range(shape.n) if shape.two else range(1)
    found: tuple[int, int, float] | None = None
    ranks: Sequence[int] = range(shape.n)
    if shape.two and shape.region is None:
        # A rank keeps the share it reduces in its own buffer: it copies it into its slot (FILLED) for this
        # scan. A rank that never does (late, gone) is left out; the others' pieces still decide.
        try:
            win.wait(ranks, FILLED, t0 + k + 1, min(5.0, max(1.0, coll.timeout or 1.0)))
        except Exception:  # noqa: BLE001 - see above
            ranks = [r for r in ranks if win.counter(r, FILLED) >= t0 + k + 1]
    for r in ranks:
        for q in shares:
            a, _ = shape.share(k, q)
            x = shape.data(win, r, t0, k, q).view(wdt)
            i = _first_bad(x, fmt)
            if i >= 0:
                found = (r, a + i, _value(x, i, fmt))
                break
        if found:
            break
    marker = None
    if found is None:  # no bad input: a sum overflowed; the first bad result names where
        for q in shares:
            a, b = shape.share(k, q)
            res = (shape.result(win, q, t0, k).view(wdt)[: b - a] if shape.two
                   else buf.reshape(-1)[a:b])
            i = _first_bad(res, fmt if shape.two else None)
            if i >= 0:
                marker = (a + i, _value(res, i, fmt if shape.two else None))
                break
        marker = marker or (shape.share(k, 0)[0], float("nan"))
    from ._window_py import DONE

    win.publish(DONE, t0 + k + 1)
    try:  # every rank has read the piece before any returns to its caller (who may then write its region)
        win.wait(range(shape.n), DONE, t0 + k + 1, min(5.0, max(1.0, coll.timeout or 1.0)))
    except Exception:  # noqa: BLE001 - the verdict below is what every rank raises; a late peer changes nothing
        pass
    table = list(recs)
    if found is not None:
        r, i, v = found
        table[r] = table[r]._replace(status=NONFINITE, index=i, value=v)
    verdict(coll, table, ALARMS, marker=marker)
    raise AssertionError("a non-finite result always raises")  # pragma: no cover
