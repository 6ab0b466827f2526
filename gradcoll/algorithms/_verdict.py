"""One table decides what every rank raises: the status codes, the errors behind them, and their precedence.

A collective that goes wrong, or that must agree before it starts, ends up
with a *table*: one 64-byte record per rank (``_handshake.Record``) saying
what that rank called and what it saw. Two rounds fill it:

* the handshake round (``_handshake``): rank 0 collects every record and
  sends the table to everyone; a slot rank 0 got no record for is *absent*,
  with the status of what rank 0 saw on that link (``HANDSHAKE``);
* the error path of an allreduce (``_guard.fail``): every rank collects the
  others' records itself, over the transport and over the group's
  out-of-band channel (``_witness``); a record *reports* what its rank met
  on its link to ``peer``; a slot is absent when no record came, with the
  status of what this rank saw on the link to it (``ALARMS``).

``STATUSES`` is the status byte of a record and the local errors a rank
records under it (``status_of``: the most specific class wins). *Root*
statuses are a first failure someone saw directly; the others can be
consequences of one:

| code | status | recorded for | root |
| --- | --- | --- | --- |
| 0 | ok | nothing went wrong (or an alarm woke it) | no |
| 1 | non-finite | a NaN/Inf in the rank's input (``index``, ``value``) | no |
| 2 | timeout | `CollectiveTimeout` | no |
| 3 | closed | `TransportClosed`: the peer closed its link in order | no |
| 4 | broken | `TransportBroken`: the link broke from outside (end of stream, reset, dead process) | yes |
| 5 | protocol | `CollectiveMismatch` (a frame of another call) | no |
| 6 | aborted | `TransportAborted`: the link was dropped after an error elsewhere | no |
| 7 | malformed | `ProtocolError`: the peer's bytes broke the protocol | yes |
| 8 | left | this rank closed its group (``peer`` is itself) | yes |

``VERDICT`` is the decision, in precedence order: every rank walks the same
rows over the same table and raises what the first matching row says, so
every rank raises the same error naming the same ranks. The findings:
*died* is a link that broke from outside to a rank that sent no record (a
rank whose record came is alive, so its broken link is a consequence);
*malformed* a record naming the peer whose bytes broke the protocol, or an
absent slot whose bytes arrived but were no record; *left* a rank that
closed its group; *stalled* an absent slot whose link did not break, close
or lie; *link* a link failure reported by a record or seen on an absent
slot; *reported* a present record with that status; *descriptor*, *result*
and *own* what the calls were, what this rank's result holds and what it
met itself:

| # | finding | status | every rank raises |
| --- | --- | --- | --- |
| 1 | died | broken | `TransportBroken` naming the dead rank, the op and seq it died in, and who saw it |
| 2 | malformed | malformed | `ProtocolError` naming the rank whose bytes broke the protocol, and who saw it |
| 3 | left | left | `TransportClosed` naming the rank that closed its group |
| 4 | stalled | timeout | `CollectiveTimeout` naming every absent rank (``missing``): "stalled" |
| 5 | link | closed | `TransportClosed` naming the peer that closed its link |
| 6 | descriptor | any | `CollectiveMismatch` naming rank 0's call and the first that differs |
| 7 | reported | non-finite | `NonFiniteError` naming the lowest rank with a bad input |
| 8 | result | non-finite | `NonFiniteError`: a marker in the result and no bad input, so a sum overflowed |
| 9 | reported | timeout | `CollectiveTimeout` naming the peers reported stalled |
| 10 | reported | protocol | `CollectiveMismatch`: a rank received a frame of another collective |
| 11 | link | broken | `TransportBroken` naming both ends of a link that broke between live ranks |
| 12 | own | any | `GradcollError`: this rank's own error |

Why this order. A root cause comes before everything it can cause: a rank
that died makes its neighbours' links break, others' waits time out and
the ranks that noticed drop links and close groups, so the death (row 1)
is named on every rank, never the neighbour that noticed it, and never a
link another rank closed because of it (rows 3 and 5 come later, and the
error path waits for the records of ranks that closed: theirs say why).
Bytes that break the protocol (row 2) are a fault of their sender, alive
or not. A rank that closed its group while others were inside a
collective (row 3) is why they stopped. Absence (row 4) comes next: with
nobody dead, a rank that sent no record stalled, whatever links the
others dropped while waiting for it (an *aborted* absent slot counts as
stalled: this rank dropped the link itself after a timeout, or the peer
did after an error it never reported). Comparing calls needs every record
(row 6), and only ranks that made the same call can blame an input (rows
7, 8). The last rows are secondhand: a rank that timed out on a peer whose
own record is present, a stray frame, a link that broke between two ranks
that are both alive.

The records may come from different sequence numbers: a rank that
finished call N and failed in N + 1 because another rank failed in N
reports N + 1. The root-cause rows name the seq of the record that saw the
root cause (``rank 3 died during star allreduce (seq 6), seen by rank
0``), and a stall the lowest seq of the records present, so every rank
names the same call.

Each row gives the exception and its words; ``verdict`` only matches rows
and fills the words in. Changing what wins is changing this table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, cast

from ..errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GradcollError,
    NonFiniteError,
    ProtocolError,
    TransportAborted,
    TransportBroken,
    TransportClosed,
    TransportError,
)
from ._common import Coll

__all__ = ["OK", "NONFINITE", "TIMEOUT", "CLOSED", "BROKEN", "PROTOCOL", "ABORTED", "MALFORMED", "LEFT", "STATUSES",
           "LINK_ERRORS", "status_of", "is_root", "Seen", "HANDSHAKE", "ALARMS", "Rule", "VERDICT", "verdict"]

OK, NONFINITE, TIMEOUT, CLOSED, BROKEN, PROTOCOL, ABORTED, MALFORMED, LEFT = range(9)
ANY = -1


class Status(NamedTuple):
    """A record's status byte: its name, the local errors recorded under it, whom it names, whether it is a root."""

    code: int
    name: str
    caught: tuple[type[BaseException], ...]
    names_peer: bool  # a record with it blames its ``peer`` field (a link status), not its own rank
    root: bool  # a first failure seen directly, never the consequence of another


STATUSES = (
    #      code       name          recorded for                 names the peer   root
    Status(OK,        "ok",         (),                          False,           False),
    Status(NONFINITE, "non-finite", (NonFiniteError,),           False,           False),
    Status(TIMEOUT,   "timeout",    (CollectiveTimeout,),        True,            False),
    Status(CLOSED,    "closed",     (TransportClosed,),          True,            False),
    Status(BROKEN,    "broken",     (TransportBroken,),          True,            True),
    Status(PROTOCOL,  "protocol",   (CollectiveMismatch,),       False,           False),
    Status(ABORTED,   "aborted",    (TransportAborted,),         True,            False),
    Status(MALFORMED, "malformed",  (ProtocolError,),            True,            True),
    Status(LEFT,      "left",       (),                          True,            True),
)

#: The errors of a collective's links (every failure status but a bad input), which a rank records in its
#: table instead of raising them at once.
LINK_ERRORS = tuple(cls for s in STATUSES if s.code not in (OK, NONFINITE) for cls in s.caught)

# status_of checks subclasses before their bases (an aborted link is also a broken one).
_MOST_SPECIFIC = sorted(STATUSES, key=lambda s: -max((len(c.__mro__) for c in s.caught), default=0))


def status_of(exc: BaseException) -> int:
    """The status code a rank records for ``exc`` (PROTOCOL for anything the table does not know)."""
    for s in _MOST_SPECIFIC:
        if isinstance(exc, s.caught):
            return s.code
    return PROTOCOL


def is_root(status: int) -> bool:
    """True for a status that is a first failure seen directly (``STATUSES``' root column)."""
    return 0 <= status < len(STATUSES) and STATUSES[status].root


class Seen(NamedTuple):
    """How a table was collected, which the words of the verdict say."""

    collector: int | None  # the rank that saw the absent slots (None: each rank saw its own)
    span: str  # when a link failure may have happened
    absent: str  # why an absent rank counts as absent
    late: str  # the words for an absent rank told to itself (only a collector can say it)
    to: str  # whom a malformed record was sent to
    record: str  # what a record is called


HANDSHAKE = Seen(0, "before or during", "rank 0 waited for them",
                 "this rank arrived too late; rank 0 stopped waiting for rank(s) {who}", "rank 0", "handshake")
ALARMS = Seen(None, "during", "no data and no error record came from them", "", "this rank", "error record")


class Slot(Protocol):
    """What the verdict reads of a record (``_handshake.Record``)."""

    @property
    def present(self) -> int: ...
    @property
    def status(self) -> int: ...
    @property
    def peer(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def value(self) -> float: ...
    @property
    def seq(self) -> int: ...
    def desc(self) -> tuple[int, ...]: ...
    def describe(self) -> str: ...
    def op_name(self) -> str: ...


class Rule(NamedTuple):
    """One row of the verdict: what it looks for, and what every rank then raises, in which words."""

    finding: str  # "died", "malformed", "left", "stalled", "link", "descriptor", "reported", "result" or "own"
    status: int  # the status it looks for (ANY: every one)
    raises: type[GradcollError]
    words: str  # the message after "rank {me}: " (a str.format template)


VERDICT = (
    #    finding       status     every rank raises    words
    Rule("died",       BROKEN,    TransportBroken,     "rank {p} died during {op}, seen by rank {w}{mine}"),
    Rule("malformed",  MALFORMED, ProtocolError,       "rank {p} sent bytes that break the protocol during {op}, "
                                                       "seen by rank {w}{mine}"),
    Rule("left",       LEFT,      TransportClosed,     "rank {p} closed its process group during {op}{mine}"),
    Rule("stalled",    TIMEOUT,   CollectiveTimeout,   "rank(s) {who} stalled in {op}: {absent}"),
    Rule("link",       CLOSED,    TransportClosed,     "peer {p} closed the link {span} {where}{seen}"),
    Rule("descriptor", ANY,       CollectiveMismatch,  "collective mismatch: rank 0 called {ref} but rank {p} called {call}"),
    Rule("reported",   NONFINITE, NonFiniteError,      "rank {p} contributed {value!r} at element {index}"),
    Rule("result",     NONFINITE, NonFiniteError,      "the reduced sum overflowed although every input was finite"),
    Rule("reported",   TIMEOUT,   CollectiveTimeout,   "peer(s) {who} stopped responding (seen by rank(s) {seen})"),
    Rule("reported",   PROTOCOL,  CollectiveMismatch,  "during {where}: rank {p} received a frame of another "
                                                       "collective although every rank called {ref} (do "
                                                       "check_finite or segment_bytes differ between ranks?)"),
    Rule("link",       BROKEN,    TransportBroken,     "the link between rank {lo} and rank {hi} broke {span} {where} "
                                                       "(both ranks are alive)"),
    Rule("own",        ANY,       GradcollError,       "its own error"),
)

#: A NONFINITE record in reduce_scatter's second round reports an overflowed chunk, not a bad input.
_CHUNK_OVERFLOW = ("the reduced sum overflowed to {value!r} at element {index} of rank {p}'s chunk"
                   " although every input was finite")

#: Statuses of an absent slot that count it as stalled: nothing came, and the link did not break, close or lie.
_STALLED = (TIMEOUT, ABORTED)
#: Link statuses the "link ... broken" row takes: broken between live ranks, or dropped after an error.
_LINK_BROKEN = (BROKEN, ABORTED)

Hit = tuple[int, int]  # (culprit, witness): the rank a finding names, and the rank that saw it (-1: this one)


def verdict(coll: Coll, table: Sequence[Slot], seen: Seen, *, own: BaseException | None = None,
            marker: tuple[int, float] | None = None, overflow: bool = False) -> None:
    """Raise what the first matching row of ``VERDICT`` says, or return when no row matches (all is well).

    ``own`` is what this rank met on its data path, ``marker`` the first
    marker in its result (``_guard.first_marker``), and ``overflow`` says
    that NONFINITE records report overflowed chunks (reduce_scatter).
    """
    if own is None and marker is None and _agreed(table):
        return  # every record came, says OK and describes the same call: no row can match
    for rule in VERDICT:
        hits = _find(rule, table, own, marker, seen, coll.rank)
        if hits:
            raise _error(coll, rule, hits, table, seen, own, marker, overflow)


def _agreed(table: Sequence[Slot]) -> bool:
    """Whether every slot of ``table`` is present, OK and of one call (the common case, checked first)."""
    ref = table[0].desc() if table else None
    return all(s.present and s.status == OK and s.desc() == ref for s in table)


def _find(rule: Rule, table: Sequence[Slot], own: BaseException | None, marker: tuple[int, float] | None,
          seen: Seen, me: int) -> list[Hit]:
    """The (culprit, witness) pairs that match ``rule``, lowest culprit first, then lowest witness."""
    f, want = rule.finding, rule.status
    if f == "own":
        return [(-1, -1)] if own is not None else []
    if f == "result":
        return [(-1, -1)] if marker is not None else []
    if f == "descriptor":
        ref = _reference(table).desc()
        return [(p, -1) for p, s in enumerate(table) if s.present and s.desc() != ref]
    if f == "reported":
        return [(p, -1) for p, s in enumerate(table) if s.present and s.status == want
                and (not STATUSES[want].names_peer or s.peer >= 0)]
    collector = me if seen.collector is None else seen.collector
    absent_as = _ABSENT.get((f, want), ())
    local = [(p, collector) for p, s in enumerate(table) if not s.present and s.status in absent_as]
    reported = [(s.peer, q) for q, s in enumerate(table)  # what the present records report about a peer
                if s.present and 0 <= s.peer < len(table) and _reports(f, want, s.status, s.peer == q,
                                                                       bool(table[s.peer].present))]
    if seen.collector is None:
        # Every rank has the same records, but an absent slot's status is what this rank alone saw: a
        # culprit some record names is named as that record says, so that every rank words it alike.
        named = {p for p, _ in reported}
        local = [h for h in local if h[0] not in named]
    # The lowest culprit; of its witnesses, the one that saw it in the earliest call, then the lowest rank:
    # a rank that failed a call later because of the same death saw a consequence.
    return sorted(local + reported, key=lambda h: (h[0], table[h[1]].seq if table[h[1]].present else 1 << 62, h[1]))


#: The statuses of an absent slot each link finding takes (what this rank, or rank 0, saw on the link to it).
_ABSENT = {("died", BROKEN): (BROKEN,), ("malformed", MALFORMED): (MALFORMED, PROTOCOL), ("stalled", TIMEOUT): _STALLED,
           ("link", CLOSED): (CLOSED,), ("link", BROKEN): _LINK_BROKEN}


def _reports(finding: str, want: int, status: int, itself: bool, named_present: bool) -> bool:
    """Whether a present record with ``status`` about a peer (``itself``: its own rank) counts for the finding."""
    if finding == "died":  # a rank whose own record came is alive: its broken link is a consequence
        return status == BROKEN and not named_present
    if finding == "malformed":
        return status == MALFORMED
    if finding == "left":
        return status == LEFT and itself
    if finding == "link":
        return status == CLOSED if want == CLOSED else status in _LINK_BROKEN and named_present
    return False


def _reference(table: Sequence[Slot]) -> Slot:
    """The call every other is compared with: rank 0's record, or the first present one."""
    return next((s for s in table if s.present), table[0])


def _where(coll: Coll, table: Sequence[Slot], witness: int, me: int) -> str:
    """``ring allreduce (seq 6)``: the call a root cause was seen in (the witness's, when its seq differs)."""
    rec = table[witness] if 0 <= witness < len(table) and witness != me else None
    if rec is not None and rec.present and rec.seq != coll.seq:
        return f"{rec.op_name()} (seq {rec.seq})"
    return f"{coll.name} (seq {coll.seq})"


def _mine(coll: Coll, where: str) -> str:
    """What this rank was doing, when that is not the call the verdict names."""
    if not where.endswith(f"(seq {coll.seq})"):
        return f"; this rank stopped in {coll.where()}"
    return f"; this rank stopped at step {coll.step}/{coll.steps}" if coll.steps else ""


def _error(coll: Coll, rule: Rule, hits: list[Hit], table: Sequence[Slot], seen: Seen, own: BaseException | None,
           marker: tuple[int, float] | None, overflow: bool) -> BaseException:
    """The exception ``rule`` raises for ``hits``, in its words."""
    me, f = coll.rank, rule.finding
    if f == "own":
        assert own is not None
        return own  # in its own words, with the step
    if f == "result":
        index, value = marker or (-1, float("nan"))
        return _nonfinite(coll, None, index, value, rule.words + (f" (first at element {index})" if index >= 0 else ""))
    p, w = hits[0]
    if f in ("died", "malformed", "left"):
        at = _where(coll, table, w if f != "left" else p, me)
        words = rule.words.format(p=p, w=w, op=at, mine=_mine(coll, at))
        if f == "malformed":
            return ProtocolError(f"rank {me}: {words}", rank=me, peer=p)
        return cast("type[TransportError]", rule.raises)(f"rank {me}: {words}", rank=me, peer=p)
    if f == "stalled":
        return _stalled(coll, sorted({q for q, _ in hits}), table, seen)
    where = coll.where()
    if f == "link":
        by = "" if w == me and seen.collector is None else f" (seen by rank {w})"
        words = rule.words.format(p=p, lo=min(p, w), hi=max(p, w), span=seen.span, where=where, seen=by)
        return cast("type[TransportError]", rule.raises)(f"rank {me}: {words}", rank=me, peer=p)
    s = table[p]
    if f == "reported" and rule.status == TIMEOUT:
        stalled = sorted({table[q].peer for q, _ in hits})
        by = ", ".join(str(q) for q, r in enumerate(table) if r.present and r.status == TIMEOUT)
        return coll.timeout_error(stalled, rule.words.format(who=", ".join(map(str, stalled)), seen=by))
    if f == "reported" and rule.status == NONFINITE:
        words = (_CHUNK_OVERFLOW if overflow else rule.words).format(p=p, value=s.value, index=s.index)
        return _nonfinite(coll, None if overflow else p, s.index, s.value, words)
    ref = _reference(table)
    words = rule.words.format(p=p, where=where, ref=ref.describe(), call=s.describe())
    return rule.raises(f"rank {me}: {words}")


def _stalled(coll: Coll, who: list[int], table: Sequence[Slot], seen: Seen) -> CollectiveTimeout:
    """Every absent rank stalled: a CollectiveTimeout naming them and the lowest call any record reports."""
    names = ", ".join(map(str, who))
    if coll.rank in who and seen.collector is not None:
        return coll.timeout_error(who, seen.late.format(who=names))
    present = [s for s in table if s.present]
    first = min(present, key=lambda s: s.seq) if present else None
    name, seq = (first.op_name(), first.seq) if first is not None and first.seq < coll.seq else (coll.name, coll.seq)
    at = f"{name} (seq {seq})"
    words = VERDICT[3].words.format(who=names, op=at, absent=seen.absent)
    return CollectiveTimeout(f"rank {coll.rank}: {words} (timeout {coll.timeout}s, a buffer of {coll.nbytes} bytes"
                             f"{_mine(coll, at)})", rank=coll.rank, missing=who, op=name, seq=seq, nbytes=coll.nbytes)


def _nonfinite(coll: Coll, contributor: int | None, index: int, value: float, what: str) -> NonFiniteError:
    """The NonFiniteError every rank raises: ``contributor`` is the bad input's rank (None: an overflow)."""
    return NonFiniteError(f"rank {coll.rank}: non-finite gradient in {coll.where()}: {what}; every rank halts",
                          contributor=contributor, index=index, value=value, rank=coll.rank, seq=coll.seq)
