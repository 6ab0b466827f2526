"""The per-collective handshake: who is here, what they called, whether their inputs are finite.

Before any data moves, every rank sends rank 0 a fixed-size *record*: the
collective's descriptor (kind, algorithm, op, dtype, element count, root,
sequence number) and the status of its local input (finite, or the first
NaN/Inf: index and value). Rank 0 waits for all records until the deadline
and sends every rank the whole *table* (one slot per rank, and a last slot
that stays OK: the wire keeps it). Every rank then runs the same pure
function over the same table, the verdict of ``gradcoll.algorithms._verdict``,
so every rank reaches the same decision and raises the same error, naming
the same ranks:

* a slot rank 0 never received: [`CollectiveTimeout`][gradcoll.errors.CollectiveTimeout] naming exactly the
  ranks that did not arrive (rank 0 saw who was missing);
* a peer whose link closed or broke: [`TransportClosed`][gradcoll.errors.TransportClosed] /
  [`TransportBroken`][gradcoll.errors.TransportBroken] naming it;
* a descriptor that differs from rank 0's: [`CollectiveMismatch`][gradcoll.errors.CollectiveMismatch]
  naming both ranks and both descriptors;
* a non-finite input: [`NonFiniteError`][gradcoll.errors.NonFiniteError] naming the lowest such rank,
  its element index and value (Jidoka: every rank halts, none returns).

Records and tables have a fixed length for a given world size, whatever the
ranks called, so a mismatch can never make a message the wrong size; that is
why this is a separate tiny round rather than a header glued to the data.
It also makes a correct barrier (nobody leaves before rank 0 heard from all).
Cost: one record up and one table down per rank, ``64 (n + 1)`` bytes.
A rank waiting for the table allows a grace period past the timeout, so that
rank 0's verdict about *other* missing ranks arrives before it gives up on
rank 0 itself. The error path of the allreduces (``_guard``) sends the same
records.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from .. import kernels
from ..errors import CollectiveMismatch, CollectiveTimeout, NonFiniteError, ProtocolError, TransportBroken, TransportClosed, UsageError
from . import tags
from ._common import Coll
from ._verdict import HANDSHAKE, LINK_ERRORS, MALFORMED, NONFINITE, OK, status_of, verdict

__all__ = ["Record", "ROOT", "RECORD_SIZE", "descriptor", "make_record", "with_status", "local_status", "handshake",
           "pack", "unpack", "absent"]

ROOT = 0

KINDS = ("?", "allreduce", "broadcast", "allgather", "reduce_scatter", "barrier")
#: Schedule codes of the records: these first, then each schedule the registry adds (``register_algo``), in its
#: order, the same on every rank.
ALGOS = ["-", "ring", "star", "recursive_doubling", "tree", "direct", "two_level", "halving_doubling"]
OP_CODES = ("-", "mean", "sum", "max", "min")

# present, kind, algo, op, dtype char, itemsize, root, count, seq, status, peer, index, value (64 bytes)
_REC = struct.Struct("<BBBBBxHiqqB7xqqd4x")
RECORD_SIZE = _REC.size


class Record(NamedTuple):
    """One slot of the handshake table."""

    kind: int
    algo: int
    op: int
    dtype: int
    itemsize: int
    root: int
    count: int  # type: ignore[assignment]  # shadows tuple.count on purpose (wire field name)
    seq: int
    status: int = OK
    peer: int = -1
    index: int = -1  # type: ignore[assignment]  # shadows tuple.index (wire field name)
    value: float = 0.0
    present: int = 1

    def desc(self) -> tuple[int, ...]:
        """The fields every rank must agree on."""
        return self[:8]

    def describe(self) -> str:
        """``allreduce(op=mean, float32, count=10, algorithm=ring) at seq 5``."""
        parts = []
        if self.op:
            parts.append(f"op={OP_CODES[self.op]}")
        if self.dtype:
            try:
                parts.append(np.dtype(chr(self.dtype)).name)
            except TypeError:
                parts.append(f"dtype code {self.dtype}")
            parts.append(f"count={self.count}")
        if self.algo:
            parts.append(f"algorithm={ALGOS[self.algo]}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        return f"{KINDS[self.kind]}({', '.join(parts)}) at seq {self.seq}"

    def op_name(self) -> str:
        """``ring allreduce``: the collective's name, as its own rank's messages give it."""
        algo = ALGOS[self.algo].replace("_", "-") if self.algo else ""
        return f"{algo} {KINDS[self.kind] if self.kind else 'collective'}".strip()


_KIND = {k: i for i, k in enumerate(KINDS)}
_ALGO = {a: i for i, a in enumerate(ALGOS)}
_OP = {o: i for i, o in enumerate(OP_CODES)}


def register_algo(name: str) -> int:
    """The record code of schedule ``name`` (a new one gets the next code; at most 255)."""
    if name not in _ALGO:
        if len(ALGOS) >= 255:
            raise UsageError(f"no record code left for schedule {name!r}")
        ALGOS.append(name)
        _ALGO[name] = len(ALGOS) - 1
    return _ALGO[name]


def descriptor(kind: str, algo: str, op: str | None, dtype: np.dtype | None, count: int, seq: int,
               root: int = -1) -> tuple[int, ...]:
    """The fields of a record every rank must agree on (``Record.desc()``), without building the record."""
    return (_KIND[kind], _ALGO[algo], _OP[op or "-"], ord(dtype.char) if dtype is not None else 0,
            dtype.itemsize if dtype is not None else 0, root, count, seq)


def make_record(kind: str, algo: str, op: str | None, dtype: np.dtype | None, count: int, seq: int,
                root: int = -1, status: tuple[int, int, float] | None = None) -> Record:
    """This rank's record; ``status`` is ``(NONFINITE, index, value)`` from ``local_status``."""
    return with_status(descriptor(kind, algo, op, dtype, count, seq, root), status)


def with_status(desc: tuple[int, ...], status: tuple[int, int, float] | None, peer: int = -1) -> Record:
    """The record of call ``desc`` reporting ``status`` (None: OK) met on the link to ``peer``."""
    code, index, value = status or (OK, -1, 0.0)
    return Record(*desc, code, peer, index, value)  # type: ignore[call-arg]  # the 8 descriptor fields


def local_status(flat: np.ndarray, check: bool, backend: str | None = None) -> tuple[int, int, float] | None:
    """``None`` if ``flat`` is finite (or unchecked), else ``(NONFINITE, index, value)``."""
    if not check or flat.size == 0:
        return None
    try:
        kernels.check_finite(flat, backend=backend)
    except NonFiniteError as exc:
        return NONFINITE, int(exc.index or 0), float(exc.value if exc.value is not None else np.nan)
    return None


def pack(recs: list[Record]) -> bytearray:
    """Records on the wire, 64 bytes each."""
    out = bytearray(RECORD_SIZE * len(recs))
    for i, r in enumerate(recs):
        _REC.pack_into(out, i * RECORD_SIZE, r.present, r.kind, r.algo, r.op, r.dtype, r.itemsize, r.root,
                       r.count, r.seq, r.status, r.peer, r.index, r.value)
    return out


def unpack(buf: bytes | bytearray, n: int) -> list[Record]:
    """``n`` records off the wire; ProtocolError for a field out of range."""
    recs = []
    for i in range(n):
        present, *fields = _REC.unpack_from(buf, i * RECORD_SIZE)
        kind, algo, op = fields[:3]
        if present > 1 or kind >= len(KINDS) or algo >= len(ALGOS) or op >= len(OP_CODES):
            raise ProtocolError(f"malformed handshake record {i}")
        recs.append(Record(*fields, present))  # type: ignore[call-arg]  # 12 wire fields, then present
    return recs


def absent(status: int) -> Record:
    """The slot of a rank whose record did not come: ``status`` says what its link did instead."""
    return Record(0, 0, 0, 0, 0, -1, 0, 0, status=status, present=0)


def send_record(coll: Coll, rec: Record) -> None:
    """Non-root: send this rank's record to rank 0."""
    coll.wait(coll.isend(ROOT, pack([rec]), tags.HANDSHAKE_UP), ROOT)


def receive_all(coll: Coll, bufs: dict[int, Any], tag: int) -> dict[int, int]:
    """Receive one message from each peer ``p`` into ``bufs[p]`` until the deadline.

    Returns ``{peer: status}`` for the peers that failed (TIMEOUT, CLOSED,
    BROKEN, PROTOCOL); failures are recorded, never raised, because rank 0
    must still send its verdict to everyone else.
    """
    failed: dict[int, int] = {}
    reqs = {}
    for p, buf in bufs.items():
        try:
            reqs[p] = coll.t.irecv(p, buf, tag)
        except LINK_ERRORS as exc:
            failed[p] = status_of(exc)
    for p, req in reqs.items():
        try:
            req.wait(coll.deadline.remaining())
        except LINK_ERRORS as exc:
            failed[p] = status_of(exc)
    return failed


def gather_records(coll: Coll, own: Record) -> list[Record]:
    """Rank 0: collect every record until the deadline; returns the table (n slots and the last one)."""
    n = coll.size
    bufs = {p: bytearray(RECORD_SIZE) for p in range(1, n)}
    failed = receive_all(coll, bufs, tags.HANDSHAKE_UP)
    table = [own]
    for p in range(1, n):
        try:
            table.append(absent(failed[p]) if p in failed else unpack(bufs[p], 1)[0])
        except ProtocolError:
            table.append(absent(MALFORMED))
    return table + [Record(0, 0, 0, 0, 0, -1, 0, 0)]  # the last slot, always OK


def send_table(coll: Coll, table: list[Record]) -> None:
    """Rank 0: send the table to every peer (best effort: a dead peer is already in the table)."""
    data = pack(table)
    reqs = []
    for p in range(1, coll.size):
        try:
            reqs.append(coll.t.isend(p, data, tags.HANDSHAKE_DOWN))
        except (TransportClosed, TransportBroken):
            pass
    limit = coll.deadline.remaining()
    for req in reqs:
        try:
            req.wait(None if limit is None else max(limit, 1.0))
        except (CollectiveTimeout, TransportClosed, TransportBroken):
            pass


def recv_table(coll: Coll) -> list[Record]:
    """Non-root: wait for rank 0's table (timeout plus a grace period)."""
    n = coll.size
    buf = bytearray(RECORD_SIZE * (n + 1))
    extra = min(5.0, 0.5 * coll.timeout)
    remaining = coll.deadline.remaining()
    try:
        coll.t.irecv(ROOT, buf, tags.HANDSHAKE_DOWN).wait(None if remaining is None else remaining + extra)
    except CollectiveTimeout as exc:
        raise coll.timeout_error([ROOT], "rank 0 did not arrive (it coordinates every collective)") from exc
    except (TransportClosed, TransportBroken, CollectiveMismatch) as exc:
        raise coll.translate(exc, ROOT) from exc
    return unpack(buf, n + 1)


def handshake(coll: Coll, rec: Record, overflow: bool = False) -> None:
    """Run the whole handshake for ``rec`` and raise the verdict's error, if any (``_verdict.VERDICT``).

    With ``overflow`` a NONFINITE record reports a reduced chunk that
    overflowed, not a bad input.
    """
    if coll.size == 1:
        table = [rec]
    elif coll.rank == ROOT:
        table = gather_records(coll, rec)
        send_table(coll, table)
    else:
        send_record(coll, rec)
        table = recv_table(coll)
    verdict(coll, table[: coll.size], HANDSHAKE, overflow=overflow)
