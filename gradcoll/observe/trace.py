"""Per-collective records, ``ProcessGroup.stats()`` and Chrome traces.

Every collective a [`ProcessGroup`][gradcoll.group.ProcessGroup] runs leaves one
record: operation, algorithm, sequence number, bytes, start (the rank's
*arrival*), end, and the time the rank spent blocked waiting for its peers
inside the transport (``wait_s``; the rest of the duration is copying,
reducing and Python). The last ``window`` records are kept in a ring buffer;
the per-operation totals cover every collective since the group was built.

``stats().hosts`` is the group's host layout (the host of every rank), and
a trace names each rank's track ``rank R @ HOST`` and keeps the layout
under ``otherData.gradcoll.hosts``.

A trace is the same records written as Chrome trace JSON (``chrome://tracing``,
Perfetto): ``{"traceEvents": [...]}`` with one complete event (``ph "X"``) per
collective and ``pid`` = rank, so each rank is one track. Each rank writes
its own file ([`trace_path`][gradcoll.observe.trace.trace_path] names it); [`merge`][gradcoll.observe.trace.merge] joins them, and
``gradcoll stragglers`` reads either. Times are wall-clock microseconds
(``time.time``), so traces of ranks on different hosts line up only as well
as their clocks do.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CollectiveRecord", "OpStats", "GroupStats", "Recorder", "trace_path", "load_events", "merge"]

#: At most this many events are kept per trace (the oldest are dropped after that).
MAX_TRACE_EVENTS = 1_000_000


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective on one rank; times are wall-clock seconds (``time.time``)."""

    op: str
    algorithm: str
    seq: int
    nbytes: int
    start: float
    end: float
    wait_s: float
    ok: bool = True

    @property
    def duration(self) -> float:
        """Seconds from arrival to completion."""
        return self.end - self.start


@dataclass(frozen=True)
class OpStats:
    """Totals of one operation (``"allreduce"``, ``"broadcast"``, ...)."""

    count: int
    bytes: int
    total_s: float
    wait_s: float
    failed: int = 0

    @property
    def avg_s(self) -> float:
        """Mean duration in seconds."""
        return self.total_s / self.count if self.count else 0.0

    @property
    def avg_wait_s(self) -> float:
        """Mean time blocked on peers, in seconds."""
        return self.wait_s / self.count if self.count else 0.0


@dataclass(frozen=True)
class GroupStats:
    """What [`ProcessGroup.stats`][gradcoll.group.ProcessGroup.stats] returns: totals, per-operation totals and the recent records."""

    rank: int
    size: int
    count: int
    bytes: int
    total_s: float
    wait_s: float
    ops: dict[str, OpStats] = field(default_factory=dict)
    recent: list[CollectiveRecord] = field(default_factory=list)
    hosts: tuple[str, ...] | None = None
    """The host of every rank (None when the group does not know its layout)."""

    @property
    def host_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's host (this one alone when the layout is unknown)."""
        if self.hosts is None:
            return (self.rank,)
        return tuple(r for r, h in enumerate(self.hosts) if h == self.hosts[self.rank])


_OPS = ("allreduce_many", "allreduce", "broadcast", "allgather", "reduce_scatter", "barrier")


def _split(name: str) -> tuple[str, str]:
    """``"ring allreduce (bf16 wire)"`` -> ``("allreduce", "ring (bf16 wire)")``; ``"broadcast"`` -> ``("broadcast", "")``."""
    words = name.split()
    for i, w in enumerate(words):
        if w in _OPS:
            return w, " ".join(words[:i] + words[i + 1:])
    return name, ""


class Recorder:
    """The records of one group (not thread-safe: a group runs one collective at a time)."""

    def __init__(self, rank: int, size: int, window: int = 1024, hosts: tuple[str, ...] | None = None) -> None:
        self.rank, self.size, self.hosts = rank, size, hosts
        self._recent: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=max(1, window))
        self._totals: dict[str, list[float]] = {}  # op -> [count, bytes, total_s, wait_s, failed]
        self._ops: dict[str, str] = {}  # collective name -> op, parsed once
        self._events: collections.deque[dict[str, Any]] | None = None
        self._wall = time.time() - time.perf_counter()  # perf_counter -> wall clock
        #: The running collective: (name, seq, nbytes, start perf_counter, blocked_s at start), or None.
        self.current: tuple[str, int, int, float, float] | None = None
        self.last_end = time.perf_counter()  # when the last collective finished (for "idle for")

    def begin(self, name: str, seq: int, nbytes: int, blocked: float) -> None:
        """A collective starts on this rank (its arrival)."""
        self.current = (name, seq, nbytes, time.perf_counter(), blocked)

    def end(self, blocked: float, ok: bool) -> None:
        """The running collective finished (``ok``) or raised."""
        cur = self.current
        if cur is None:
            return
        self.current = None
        name, seq, nbytes, t0, b0 = cur
        t1 = self.last_end = time.perf_counter()
        wait = blocked - b0
        self._recent.append((name, seq, nbytes, t0, t1, wait, ok))
        op = self._ops.get(name)
        if op is None:
            op = self._ops[name] = _split(name)[0]
        tot = self._totals.get(op)
        if tot is None:
            tot = self._totals[op] = [0, 0, 0.0, 0.0, 0]
        tot[0] += 1
        tot[1] += nbytes
        tot[2] += t1 - t0
        tot[3] += wait
        tot[4] += not ok
        if self._events is not None:
            self._events.append(self._event(name, seq, nbytes, t0, t1, wait, ok))

    def _record(self, raw: tuple[Any, ...]) -> CollectiveRecord:
        name, seq, nbytes, t0, t1, wait, ok = raw
        op, algo = _split(name)
        return CollectiveRecord(op, algo, seq, nbytes, self._wall + t0, self._wall + t1, wait, ok)

    def _event(self, name: str, seq: int, nbytes: int, t0: float, t1: float, wait: float, ok: bool) -> dict[str, Any]:
        op, algo = _split(name)
        return {
            "name": name, "cat": "collective", "ph": "X", "pid": self.rank, "tid": 0,
            "ts": round((self._wall + t0) * 1e6, 3), "dur": round((t1 - t0) * 1e6, 3),
            "args": {"op": op, "algorithm": algo, "seq": seq, "bytes": nbytes,
                     "wait_us": round(wait * 1e6, 3), "ok": ok, "size": self.size},
        }

    def stats(self) -> GroupStats:
        """Totals since the group was built, plus the records still in the ring buffer."""
        ops = {op: OpStats(int(c), int(b), t, w, int(f)) for op, (c, b, t, w, f) in self._totals.items()}
        return GroupStats(
            rank=self.rank, size=self.size,
            count=sum(s.count for s in ops.values()), bytes=sum(s.bytes for s in ops.values()),
            total_s=sum(s.total_s for s in ops.values()), wait_s=sum(s.wait_s for s in ops.values()),
            ops=ops, recent=[self._record(r) for r in self._recent], hosts=self.hosts,
        )

    # -- tracing -------------------------------------------------------------
    @property
    def tracing(self) -> bool:
        """True between [`start_trace`][gradcoll.observe.trace.Recorder.start_trace] and [`stop_trace`][gradcoll.observe.trace.Recorder.stop_trace]."""
        return self._events is not None

    def start_trace(self) -> None:
        """Start keeping trace events (a no-op while tracing)."""
        if self._events is None:
            self._events = collections.deque(maxlen=MAX_TRACE_EVENTS)

    def stop_trace(self, path: str | None) -> str | None:
        """Stop tracing; write this rank's events to ``trace_path(path)`` and return that path (if ``path``)."""
        events, self._events = self._events, None
        if path is None or events is None:
            return None
        out = trace_path(path, self.rank, self.size)
        host = f" @ {self.hosts[self.rank]}" if self.hosts is not None else ""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"name": f"rank {self.rank}{host}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}}]
        doc = {"traceEvents": meta + list(events), "displayTimeUnit": "ms",
               "otherData": {"gradcoll": {"rank": self.rank, "size": self.size,
                                          "hosts": None if self.hosts is None else list(self.hosts)}}}
        tmp = f"{out}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, out)
        return out


def trace_path(path: str, rank: int, size: int) -> str:
    """The file rank ``rank`` writes for trace ``path``.

    ``{rank}`` in ``path`` is replaced by the rank; otherwise, in a group of
    more than one rank, ``.rank<r>`` goes before the extension
    (``run.json`` -> ``run.rank3.json``), so ranks sharing a file system
    never overwrite each other.
    """
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if size == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def load_events(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every event of the Chrome trace files ``paths`` (per-rank or merged)."""
    events: list[dict[str, Any]] = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
        events.extend(doc["traceEvents"] if isinstance(doc, dict) else doc)
    return events


def merge(paths: Iterable[str], out: str) -> str:
    """Write one Chrome trace holding every event of the trace files ``paths``; returns ``out``."""
    events = load_events(paths)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out
