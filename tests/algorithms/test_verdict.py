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
from gradcoll.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GradcollError,
    NonFiniteError,
    ProtocolError,
    TransportAborted,
    TransportBroken,
    TransportClosed,
)
from gradcoll.transport.frame import FrameMismatch
from gradcoll.transport.inproc import create_world

N = 4
BASE = make_record("allreduce", "ring", "mean", np.dtype(np.float32), 10, 5)


def coll(rank: int = 0) -> Coll:
    return Coll(create_world(N, timeout=1.0)[rank], "ring allreduce", 5, 40, 1.0)


# -- the status table ------------------------------------------------------------------

def test_status_codes_are_their_rows_and_the_wire_bytes() -> None:
    assert [s.code for s in V.STATUSES] == list(range(len(V.STATUSES)))
    assert (V.OK, V.NONFINITE, V.TIMEOUT, V.CLOSED, V.BROKEN, V.PROTOCOL, V.ABORTED, V.MALFORMED, V.LEFT) == tuple(range(9))
    for s in V.STATUSES:  # every status survives the 64-byte record
        rec = BASE._replace(status=s.code, peer=2, index=7, value=1.5)
        assert unpack(pack([rec]), 1) == [rec]
    assert [s.name for s in V.STATUSES if s.root] == ["broken", "malformed", "left"]


@pytest.mark.parametrize("status", V.STATUSES, ids=lambda s: s.name)
def test_every_exception_maps_to_its_status(status: Any) -> None:
    for cls in status.caught:
        exc = cls("x") if cls is not FrameMismatch else cls("x", peer=1, tag=0, payload=b"")
        assert V.status_of(exc) == status.code, cls


def test_status_of_subclasses_and_strangers() -> None:
    assert V.status_of(FrameMismatch("x", peer=1, tag=0, payload=b"")) == V.PROTOCOL  # a CollectiveMismatch
    assert V.status_of(TransportAborted("x")) == V.ABORTED  # a TransportBroken, but a consequence
    assert V.status_of(ValueError("x")) == V.PROTOCOL
    assert set(V.LINK_ERRORS) == {CollectiveTimeout, TransportClosed, TransportBroken, TransportAborted,
                                  CollectiveMismatch, ProtocolError}


def test_docstring_status_table_is_the_table() -> None:
    rows = re.findall(r"^\| (\d+) \| ([a-z-]+) \| .* \| (yes|no) \|$", V.__doc__ or "", re.M)
    assert [(int(c), name, root == "yes") for c, name, root in rows] == [(s.code, s.name, s.root) for s in V.STATUSES]


def test_docstring_verdict_table_is_the_table() -> None:
    rows = re.findall(r"^\| (\d+) \| ([a-z ]+) \| ([a-z-]+) \| `(\w+)`", V.__doc__ or "", re.M)
    names = {s.code: s.name for s in V.STATUSES} | {V.ANY: "any"}
    want = [(i + 1, r.finding, names[r.status], r.raises.__name__) for i, r in enumerate(V.VERDICT)]
    assert [(int(i), f, s, cls) for i, f, s, cls in rows] == want


# -- every row, and the precedence -----------------------------------------------------

# One way to make each row match, on table slot ``k`` (or on this rank's own findings), and a phrase of its words.
OWN_OTHER = CollectiveMismatch("rank 0: during ring allreduce step 1/6 (seq 5): something else")


def trigger(i: int, k: int) -> dict[str, Any]:
    rule = V.VERDICT[i]
    f, st = rule.finding, rule.status
    if f == "own":
        return {"own": OWN_OTHER}
    if f == "result":
        return {"marker": (3, float("inf"))}
    if f == "died":  # rank k's link to rank 3 broke, and rank 3 sent nothing
        return {"slot": (k, BASE._replace(status=V.BROKEN, peer=3)), "absent": 3}
    if f == "malformed":
        return {"slot": (k, BASE._replace(status=V.MALFORMED, peer=3))}
    if f == "left":
        return {"slot": (k, BASE._replace(status=V.LEFT, peer=k))}
    if f == "stalled":
        return {"slot": (k, absent(V.TIMEOUT))}
    if f == "link" and st == V.CLOSED:
        return {"slot": (k, BASE._replace(status=V.CLOSED, peer=3))}
    if f == "link":  # broke between two live ranks
        return {"slot": (k, BASE._replace(status=V.BROKEN, peer=3))}
    if f == "descriptor":
        return {"slot": (k, BASE._replace(count=11))}
    extra = {"peer": 3} if st == V.TIMEOUT else {"index": 7, "value": float("inf")} if st == V.NONFINITE else {}
    return {"slot": (k, BASE._replace(status=st, **extra))}


PHRASE = {
    ("died", V.BROKEN): "rank 3 died during ring allreduce (seq 5), seen by rank",
    ("malformed", V.MALFORMED): "rank 3 sent bytes that break the protocol during ring allreduce (seq 5), seen by rank",
    ("left", V.LEFT): "closed its process group during ring allreduce (seq 5)",
    ("stalled", V.TIMEOUT): "stalled in ring allreduce (seq 5): no data and no error record came from them",
    ("link", V.CLOSED): "peer 3 closed the link during ring allreduce (seq 5) (seen by rank",
    ("descriptor", V.ANY): "collective mismatch: rank 0 called allreduce(op=mean, float32, count=10, algorithm=ring)",
    ("reported", V.NONFINITE): "contributed inf at element 7; every rank halts",
    ("result", V.NONFINITE): "the reduced sum overflowed although every input was finite (first at element 3)",
    ("reported", V.TIMEOUT): "peer(s) 3 stopped responding (seen by rank(s)",
    ("reported", V.PROTOCOL): "received a frame of another collective although every rank called",
    ("link", V.BROKEN): "broke during ring allreduce (seq 5) (both ranks are alive)",
}


def decide(triggers: list[dict[str, Any]], seen: Any = V.ALARMS, rank: int = 0) -> BaseException | None:
    table: list[Record] = [BASE] * N
    own = marker = None
    for t in triggers:
        if "slot" in t:
            k, rec = t["slot"]
            table[k] = rec
        if "absent" in t and t["absent"] != rank:
            table[t["absent"]] = absent(V.TIMEOUT)
        own = t.get("own", own)
        marker = t.get("marker", marker)
    try:
        V.verdict(coll(rank), table, seen, own=own, marker=marker)
    except BaseException as exc:  # noqa: BLE001 - the verdict's error is the result
        return exc
    return None


def assert_is_row(err: BaseException | None, i: int) -> None:
    rule = V.VERDICT[i]
    if rule.finding == "own":
        assert err is OWN_OTHER, (i, err)
        return
    assert type(err) is rule.raises, (i, err)
    assert err is not None and str(err).startswith("rank 0: "), err
    assert PHRASE[(rule.finding, rule.status)] in str(err), (i, err)


def test_every_row_its_exception_and_words() -> None:
    assert {r.raises for r in V.VERDICT} <= {TransportClosed, TransportBroken, ProtocolError, CollectiveTimeout,
                                             CollectiveMismatch, NonFiniteError, GradcollError}
    for i in range(len(V.VERDICT)):
        assert_is_row(decide([trigger(i, 1)]), i)


PAIRS = list(itertools.combinations(range(len(V.VERDICT)), 2))


@pytest.mark.parametrize("i,j", PAIRS)
def test_precedence_the_earlier_row_wins(i: int, j: int) -> None:
    a, b = trigger(i, 1), trigger(j, 2)
    assert_is_row(decide([a, b]), i)
    assert_is_row(decide([b, a]), i)  # whatever the order the findings were noted in


def test_all_well_returns() -> None:
    assert decide([]) is None
    assert decide([], V.HANDSHAKE) is None


def test_the_shortcut_takes_only_tables_no_row_matches() -> None:
    """``verdict`` returns at once for a table whose records all came, say OK and describe one call (a barrier's
    every table): every row's trigger, on any slot, keeps its table out of that shortcut."""
    assert V._agreed([BASE] * N)
    for i in range(len(V.VERDICT)):
        for k in range(N):
            t = trigger(i, k)
            if "slot" not in t:
                continue  # (this rank's own error, a marker in its result: verdict's own arguments)
            table = [BASE] * N
            table[t["slot"][0]] = t["slot"][1]
            if "absent" in t:
                table[t["absent"]] = absent(V.TIMEOUT)
            assert not V._agreed(table), (i, k)


def test_error_attributes_name_the_culprits() -> None:
    e = decide([trigger(0, 1)])  # rank 1 saw its link to rank 3 break, and rank 3 sent nothing
    assert isinstance(e, TransportBroken) and (e.rank, e.peer) == (0, 3) and ", seen by rank 1" in str(e)
    e = decide([{"slot": (2, absent(V.CLOSED))}])  # this rank saw its link to 2 close
    assert isinstance(e, TransportClosed) and e.peer == 2 and str(e).endswith("during ring allreduce (seq 5)")
    e = decide([{"slot": (1, absent(V.TIMEOUT))}, {"slot": (3, absent(V.ABORTED))}])  # 3: dropped after a timeout
    assert isinstance(e, CollectiveTimeout) and e.missing == [1, 3] and e.seq == 5 and e.nbytes == 40
    e = decide([{"slot": (3, BASE._replace(status=V.NONFINITE, index=4, value=-np.inf))},
                {"slot": (2, BASE._replace(status=V.NONFINITE, index=9, value=np.nan))}])
    assert isinstance(e, NonFiniteError) and (e.contributor, e.index, e.rank, e.seq) == (2, 9, 0, 5)
    e = decide([{"slot": (1, BASE._replace(status=V.TIMEOUT, peer=2))}, {"slot": (3, BASE._replace(status=V.TIMEOUT, peer=1))}])
    assert isinstance(e, CollectiveTimeout) and e.missing == [1, 2] and "(seen by rank(s) 1, 3)" in str(e)
    e = decide([trigger(1, 2)])
    assert isinstance(e, ProtocolError) and (e.rank, e.peer) == (0, 3)


def test_a_live_rank_is_never_the_one_that_died() -> None:
    """A broken link to a rank whose own record came is a consequence (it dropped the link, or the network did)."""
    table = [BASE, BASE._replace(status=V.BROKEN, peer=2), BASE._replace(status=V.ABORTED, peer=1), BASE]
    with pytest.raises(TransportBroken, match="the link between rank 1 and rank 2 broke") as info:
        V.verdict(coll(), table, V.ALARMS)
    assert type(info.value) is TransportBroken


def test_the_earliest_witness_names_the_death_on_every_rank() -> None:
    """Rank 2 saw rank 0 die in seq 5; rank 1, a call later, in seq 6: every rank names seq 5 and rank 2."""
    later = BASE._replace(seq=6)
    for me in (1, 2, 3):
        table = [absent(V.BROKEN if me == 3 else V.TIMEOUT), later._replace(status=V.BROKEN, peer=0),
                 BASE._replace(status=V.BROKEN, peer=0), later]
        c = Coll(create_world(N, timeout=1.0)[me], "ring allreduce", 6 if me != 2 else 5, 40, 1.0)
        with pytest.raises(TransportBroken) as info:
            V.verdict(c, table, V.ALARMS)
        assert f"rank {me}: rank 0 died during ring allreduce (seq 5), seen by rank 2" in str(info.value)


def test_a_stall_names_the_lowest_call_of_the_records() -> None:
    table = [absent(V.TIMEOUT), BASE._replace(seq=6), BASE._replace(status=V.TIMEOUT, peer=0), BASE._replace(seq=6)]
    c = Coll(create_world(N, timeout=1.0)[1], "ring allreduce", 6, 40, 1.0)
    with pytest.raises(CollectiveTimeout, match=r"rank 1: rank\(s\) 0 stalled in ring allreduce \(seq 5\)") as info:
        V.verdict(c, table, V.ALARMS)
    assert info.value.missing == [0] and info.value.seq == 5


def test_handshake_words() -> None:
    """The handshake's table is rank 0's: it saw the absent slots, and says so."""
    e = decide([{"slot": (2, absent(V.CLOSED))}], V.HANDSHAKE)
    assert str(e) == "rank 0: peer 2 closed the link before or during ring allreduce (seq 5) (seen by rank 0)"
    e = decide([{"slot": (1, absent(V.MALFORMED))}], V.HANDSHAKE)
    assert type(e) is ProtocolError and str(e) == ("rank 0: rank 1 sent bytes that break the protocol during ring "
                                                   "allreduce (seq 5), seen by rank 0")
    e = decide([{"slot": (3, absent(V.TIMEOUT))}], V.HANDSHAKE)
    assert isinstance(e, CollectiveTimeout) and "rank(s) 3 stalled in ring allreduce (seq 5): rank 0 waited" in str(e)
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


def test_a_rank_with_a_bad_input_woken_by_an_alarm_still_reports_its_input() -> None:
    """Rank 2's NaN reaches rank 1's result first; rank 1's alarm wakes rank 2 before its own result came.

    Rank 2's record must still say NONFINITE at its element, so every rank
    names rank 2 (not "the sum overflowed"); a real link error keeps its own status.
    """
    from gradcoll.algorithms import tags
    from gradcoll.algorithms._alarm import own_record

    c = coll(2)
    c.desc = BASE[:8]
    c.status = (V.NONFINITE, 7, float("nan"))
    woken = FrameMismatch("alarm", peer=1, tag=tags.ALARM, payload=b"")
    rec = own_record(c, woken)
    assert (rec.status, rec.index) == (V.NONFINITE, 7) and np.isnan(rec.value)
    table = [BASE, BASE, rec, BASE]
    with pytest.raises(NonFiniteError, match="rank 2 contributed nan at element 7") as info:
        V.verdict(coll(0), table, V.ALARMS, marker=(0, float("nan")))
    assert info.value.contributor == 2
    broken = own_record(c, TransportBroken("x", rank=2, peer=0))
    assert (broken.status, broken.peer) == (V.BROKEN, 0)
    c.status = None
    assert own_record(c, woken).status == V.OK


def test_a_link_error_while_this_rank_closes_its_group_is_that_close() -> None:
    """From the moment a rank tells its peers it closes its group (``announce_close``), they may drop their links
    before its transport is marked closed: a broken link or a peer's record where data was due is then reported
    as this rank's own close, not as a fault of the peer."""
    from gradcoll.algorithms._common import closing, note_closing
    from gradcoll.errors import TransportBroken, TransportClosed

    c = Coll(create_world(2, timeout=1.0)[0], "ring allreduce", 5, 40, 1.0)
    broken = TransportBroken("rank 0: send to peer 1: link broke (Broken pipe)", rank=0, peer=1)
    before = c.translate(broken, 1)
    assert type(before) is TransportBroken and not closing(c.t)
    note_closing(c.t)
    after = c.translate(broken, 1)
    assert type(after) is TransportClosed and "this rank's transport was closed" in str(after) and after.peer == 1
