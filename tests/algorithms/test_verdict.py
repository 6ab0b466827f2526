"""The one verdict and status table (gradcoll/algorithms/_verdict.py): every status, every row, the precedence.

The verdict is a pure function of a table of records, so these tests build
tables by hand and check what it raises; the scenarios over real links are
in test_algorithms.py and tests/faults/.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import _verdict as V
from gradcoll.algorithms._common import Coll
from gradcoll.algorithms._handshake import Record, absent, make_record, pack, unpack
from gradcoll.errors import CollectiveMismatch, CollectiveTimeout, GradcollError, NonFiniteError, ProtocolError, TransportBroken, TransportClosed
from gradcoll.transport.frame import FrameMismatch
from gradcoll.transport.inproc import create_world

N = 4
BASE = make_record("allreduce", "ring", "mean", np.dtype(np.float32), 10, 5)


def coll(rank: int = 0) -> Coll:
    return Coll(create_world(N, timeout=1.0)[rank], "ring allreduce", 5, 40, 1.0)


# -- the status table ------------------------------------------------------------------

def test_status_codes_are_their_rows_and_the_wire_bytes() -> None:
    assert [s.code for s in V.STATUSES] == list(range(len(V.STATUSES)))
    assert (V.OK, V.NONFINITE, V.TIMEOUT, V.CLOSED, V.BROKEN, V.PROTOCOL) == (0, 1, 2, 3, 4, 5)
    for s in V.STATUSES:  # every status survives the 64-byte record
        rec = BASE._replace(status=s.code, peer=2, index=7, value=1.5)
        assert unpack(pack([rec]), 1) == [rec]


@pytest.mark.parametrize("status", V.STATUSES, ids=lambda s: s.name)
def test_every_exception_maps_to_its_status(status: Any) -> None:
    for cls in status.caught:
        exc = cls("x") if cls is not FrameMismatch else cls("x", peer=1, tag=0, payload=b"")
        assert V.status_of(exc) == status.code, cls


def test_status_of_subclasses_and_strangers() -> None:
    assert V.status_of(FrameMismatch("x", peer=1, tag=0, payload=b"")) == V.PROTOCOL  # a CollectiveMismatch
    assert V.status_of(ValueError("x")) == V.PROTOCOL
    assert set(V.LINK_ERRORS) == {CollectiveTimeout, TransportClosed, TransportBroken, CollectiveMismatch,
                                  ProtocolError}


def test_docstring_status_table_is_the_table() -> None:
    rows = re.findall(r"^\| (\d+) \| ([a-z-]+) \|", V.__doc__ or "", re.M)
    assert [(int(c), name) for c, name in rows[: len(V.STATUSES)]] == [(s.code, s.name) for s in V.STATUSES]


def test_docstring_verdict_table_is_the_table() -> None:
    rows = re.findall(r"^\| (\d+) \| ([a-z ]+) \| ([a-z-]+) \| `(\w+)`", V.__doc__ or "", re.M)
    names = {s.code: s.name for s in V.STATUSES} | {V.ANY: "any"}
    want = [(i + 1, r.finding, names[r.status], r.raises.__name__) for i, r in enumerate(V.VERDICT)]
    assert [(int(i), f, s, cls) for i, f, s, cls in rows] == want


# -- every row, and the precedence -----------------------------------------------------

# One way to make each row match, on table slot ``k`` (or on this rank's own findings), and a phrase of its words.
OWN_CLOSED = TransportClosed("rank 0: peer 1 closed the link during ring allreduce step 2/6 (seq 5)", rank=0, peer=1)
OWN_BROKEN = TransportBroken("rank 0: the link to peer 1 broke during ring allreduce step 2/6 (seq 5)", rank=0, peer=1)
OWN_OTHER = CollectiveMismatch("rank 0: during ring allreduce step 1/6 (seq 5): something else")


def trigger(i: int, k: int) -> dict[str, Any]:
    rule = V.VERDICT[i]
    f, st = rule.finding, rule.status
    if f == "own link":
        return {"own": OWN_CLOSED if st == V.CLOSED else OWN_BROKEN}
    if f == "own":
        return {"own": OWN_OTHER}
    if f == "result":
        return {"marker": (3, float("inf"))}
    if f == "link":
        return {"slot": (k, BASE._replace(status=st, peer=3))}
    if f == "absent":
        return {"slot": (k, absent(V.TIMEOUT if st == V.ANY else st))}
    if f == "descriptor":
        return {"slot": (k, BASE._replace(count=11))}
    extra = {"peer": 3} if st == V.TIMEOUT else {"index": 7, "value": float("inf")} if st == V.NONFINITE else {}
    return {"slot": (k, BASE._replace(status=st, **extra))}


PHRASE = {
    ("link", V.CLOSED): "peer 3 closed the link during ring allreduce (seq 5) (seen by rank",
    ("link", V.BROKEN): "peer 3 lost the link during",
    ("absent", V.PROTOCOL): "sent this rank a malformed error record in ring allreduce",
    ("absent", V.ANY): "did not arrive (no data and no alarm from them)",
    ("descriptor", V.ANY): "collective mismatch: rank 0 called allreduce(op=mean, float32, count=10, algorithm=ring)",
    ("reported", V.NONFINITE): "contributed inf at element 7; every rank halts",
    ("result", V.NONFINITE): "the reduced sum overflowed although every input was finite (first at element 3)",
    ("reported", V.TIMEOUT): "peer(s) 3 stopped responding (seen by rank(s)",
    ("reported", V.PROTOCOL): "received a frame of another collective although every rank called",
}


def decide(triggers: list[dict[str, Any]], seen: Any = V.ALARMS) -> BaseException | None:
    table: list[Record] = [BASE] * N
    own = marker = None
    for t in triggers:
        if "slot" in t:
            k, rec = t["slot"]
            table[k] = rec
        own = t.get("own", own)
        marker = t.get("marker", marker)
    try:
        V.verdict(coll(), table, seen, own=own, marker=marker)
    except BaseException as exc:  # noqa: BLE001 - the verdict's error is the result
        return exc
    return None


def assert_is_row(err: BaseException | None, i: int) -> None:
    rule = V.VERDICT[i]
    if rule.finding in ("own link", "own"):
        assert err is trigger(i, 1)["own"], (i, err)
        return
    assert type(err) is rule.raises, (i, err)
    assert err is not None and str(err).startswith("rank 0: "), err
    assert PHRASE[(rule.finding, rule.status)] in str(err), (i, err)


def test_every_row_its_exception_and_words() -> None:
    assert {r.raises for r in V.VERDICT} <= {TransportClosed, TransportBroken, ProtocolError, CollectiveTimeout,
                                             CollectiveMismatch, NonFiniteError, GradcollError}
    for i in range(len(V.VERDICT)):
        assert_is_row(decide([trigger(i, 1)]), i)


OWN_ROWS = {i for i, r in enumerate(V.VERDICT) if r.finding in ("own link", "own")}
PAIRS = [(i, j) for i, j in itertools.combinations(range(len(V.VERDICT)), 2) if not {i, j} <= OWN_ROWS]  # one own error


@pytest.mark.parametrize("i,j", PAIRS)
def test_precedence_the_earlier_row_wins(i: int, j: int) -> None:
    a, b = trigger(i, 1), trigger(j, 2)
    assert_is_row(decide([a, b]), i)
    assert_is_row(decide([b, a]), i)  # whatever the order the findings were noted in


def test_all_well_returns() -> None:
    assert decide([]) is None
    assert decide([], V.HANDSHAKE) is None


def test_error_attributes_name_the_culprits() -> None:
    e = decide([trigger(2, 1)])  # a record of rank 1 reports peer 3 closed
    assert isinstance(e, TransportClosed) and (e.rank, e.peer) == (0, 3) and "(seen by rank 1)" in str(e)
    e = decide([{"slot": (2, absent(V.CLOSED))}])  # this rank saw its link to 2 close
    assert isinstance(e, TransportClosed) and e.peer == 2 and str(e).endswith("during ring allreduce (seq 5)")
    e = decide([{"slot": (1, absent(V.TIMEOUT))}, {"slot": (3, absent(V.TIMEOUT))}])
    assert isinstance(e, CollectiveTimeout) and e.missing == [1, 3] and e.seq == 5 and e.nbytes == 40
    e = decide([{"slot": (3, BASE._replace(status=V.NONFINITE, index=4, value=-np.inf))},
                {"slot": (2, BASE._replace(status=V.NONFINITE, index=9, value=np.nan))}])
    assert isinstance(e, NonFiniteError) and (e.contributor, e.index, e.rank, e.seq) == (2, 9, 0, 5)
    e = decide([{"slot": (1, BASE._replace(status=V.TIMEOUT, peer=2))}, {"slot": (3, BASE._replace(status=V.TIMEOUT, peer=1))}])
    assert isinstance(e, CollectiveTimeout) and e.missing == [1, 2] and "(seen by rank(s) 1, 3)" in str(e)


def test_handshake_words() -> None:
    """The handshake's table is rank 0's: it saw the absent slots, and says so."""
    e = decide([{"slot": (2, absent(V.CLOSED))}], V.HANDSHAKE)
    assert str(e) == "rank 0: peer 2 closed the link before or during ring allreduce (seq 5) (seen by rank 0)"
    e = decide([{"slot": (1, absent(V.PROTOCOL))}], V.HANDSHAKE)
    assert type(e) is ProtocolError and str(e) == "rank 0: peer 1 sent rank 0 a malformed handshake in ring allreduce (seq 5)"
    e = decide([{"slot": (3, absent(V.TIMEOUT))}], V.HANDSHAKE)
    assert isinstance(e, CollectiveTimeout) and str(e).endswith("rank(s) 3 did not arrive (rank 0 waited for them)")
    table = [BASE, BASE, absent(V.TIMEOUT), BASE]
    with pytest.raises(CollectiveTimeout, match="this rank arrived too late; rank 0 stopped waiting for rank"):
        V.verdict(coll(2), table, V.HANDSHAKE)


def test_overflowed_chunks_name_no_contributor() -> None:
    table = [BASE, BASE._replace(status=V.NONFINITE, index=5, value=np.inf), BASE, BASE]
    with pytest.raises(NonFiniteError, match="overflowed to inf at element 5 of rank 1's chunk") as info:
        V.verdict(coll(), table, V.HANDSHAKE, overflow=True)
    assert info.value.contributor is None and info.value.index == 5


def test_unknown_status_bytes_from_a_peer_are_ignored() -> None:
    """A hostile status byte matches no row (the record still counts as present and agreeing)."""
    assert decide([{"slot": (1, BASE._replace(status=200, peer=77))}]) is None
