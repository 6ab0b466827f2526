"""One table decides what every rank raises: the status codes, the errors behind them, and their precedence.

A collective that goes wrong, or that must agree before it starts, ends up
with a *table*: one 64-byte record per rank (``_handshake.Record``) saying
what that rank called and what it saw. Two rounds fill it:

* the handshake round (``_handshake``): rank 0 collects every record and
  sends the table to everyone; a slot rank 0 got no record for is *absent*,
  with the status of what rank 0 saw on that link (``HANDSHAKE``);
* the error path of an allreduce (``_guard.fail``): every rank collects the
  others' records itself; a record *reports* what its rank met on its link
  to ``peer``; a slot is absent when no record came (``ALARMS``).

``STATUSES`` is the status byte of a record and the local errors a rank
records under it (``status_of``: the first row that catches the error):

| code | status | recorded for |
| --- | --- | --- |
| 0 | ok | nothing went wrong |
| 1 | non-finite | a NaN/Inf in the rank's input (``index``, ``value``) |
| 2 | timeout | `CollectiveTimeout` |
| 3 | closed | `TransportClosed` |
| 4 | broken | `TransportBroken` |
| 5 | protocol | `CollectiveMismatch` (a frame of another call), `ProtocolError` |

``VERDICT`` is the decision, in precedence order: every rank walks the same
rows over the same table and raises what the first matching row says, so
every rank raises the same error naming the same ranks. A *link* finding is
an absent slot with that status, or a record naming the peer it met it on;
*reported* is a present record with that status; *own* and *result* are
what this rank met itself and what its result holds:

| # | finding | status | every rank raises |
| --- | --- | --- | --- |
| 1 | own link | closed | `TransportClosed`: this rank's own, which names the step |
| 2 | own link | broken | `TransportBroken`: this rank's own, which names the step |
| 3 | link | closed | `TransportClosed` naming the peer |
| 4 | link | broken | `TransportBroken` naming the peer |
| 5 | absent | protocol | `ProtocolError`: the peer's bytes arrived but were no record |
| 6 | absent | any | `CollectiveTimeout` naming every absent rank: "did not arrive" |
| 7 | descriptor | any | `CollectiveMismatch` naming rank 0's call and the first that differs |
| 8 | reported | non-finite | `NonFiniteError` naming the lowest rank with a bad input |
| 9 | result | non-finite | `NonFiniteError`: a marker in the result and no bad input, so a sum overflowed |
| 10 | reported | timeout | `CollectiveTimeout` naming the peers reported stalled |
| 11 | reported | protocol | `CollectiveMismatch`: a rank received a frame of another call |
| 12 | own | any | `GradcollError`: this rank's own error |

Why this order. Direct evidence comes before inference: a link that closed
or broke is a fact someone saw, and it is also why a record may be missing,
so it comes before absence (rows 1-6). A slot whose bytes arrived but could
not be read (row 5) is a peer that spoke, wrongly: calling it absent would
send the user looking for a dead rank. The handshake round always read it
so; the error path used to count it among the absent, and now follows the
handshake. Comparing calls needs every record (row 7), and only ranks that
made the same call can blame an input (rows 8, 9). The last rows are
secondhand: a rank that timed out on a peer whose own record is present, a
stray frame. Row 8 reads the records alone, whatever this rank met itself;
the error path used to consult them only when its own data phase had
finished, which let a rank that finished and one that did not decide
differently on one table.

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
    TransportBroken,
    TransportClosed,
    TransportError,
)
from ._common import Coll

__all__ = ["OK", "NONFINITE", "TIMEOUT", "CLOSED", "BROKEN", "PROTOCOL", "STATUSES", "LINK_ERRORS", "status_of",
           "Seen", "HANDSHAKE", "ALARMS", "Rule", "VERDICT", "verdict"]

OK, NONFINITE, TIMEOUT, CLOSED, BROKEN, PROTOCOL = range(6)
ANY = -1


class Status(NamedTuple):
    """A record's status byte: its name, the local errors recorded under it, and whom it names."""

    code: int
    name: str
    caught: tuple[type[BaseException], ...]
    names_peer: bool  # a record with it blames its ``peer`` field (a link status), not its own rank


STATUSES = (
    #      code       name          recorded for (first row wins)          names the peer
    Status(OK,        "ok",         (),                                    False),
    Status(NONFINITE, "non-finite", (NonFiniteError,),                     False),
    Status(TIMEOUT,   "timeout",    (CollectiveTimeout,),                  True),
    Status(CLOSED,    "closed",     (TransportClosed,),                    True),
    Status(BROKEN,    "broken",     (TransportBroken,),                    True),
    Status(PROTOCOL,  "protocol",   (CollectiveMismatch, ProtocolError),   False),
)

#: The errors of a collective's links (every failure status but a bad input), which a rank records in its
#: table instead of raising them at once.
LINK_ERRORS = tuple(cls for s in STATUSES if s.code not in (OK, NONFINITE) for cls in s.caught)


def status_of(exc: BaseException) -> int:
    """The status code a rank records for ``exc`` (PROTOCOL for anything the table does not know)."""
    for s in STATUSES:
        if isinstance(exc, s.caught):
            return s.code
    return PROTOCOL


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
ALARMS = Seen(None, "during", "no data and no alarm from them", "", "this rank", "error record")


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
    def desc(self) -> tuple[int, ...]: ...
    def describe(self) -> str: ...


class Rule(NamedTuple):
    """One row of the verdict: what it looks for, and what every rank then raises, in which words."""

    finding: str  # "own link", "link", "absent", "descriptor", "reported", "result" or "own"
    status: int  # the status it looks for (ANY: every one)
    raises: type[GradcollError]
    words: str  # the message after "rank {me}: " (a str.format template), or after the collective for a timeout


VERDICT = (
    #    finding       status     every rank raises    words
    Rule("own link",   CLOSED,    TransportClosed,     "its own error"),
    Rule("own link",   BROKEN,    TransportBroken,     "its own error"),
    Rule("link",       CLOSED,    TransportClosed,     "peer {p} closed the link {span} {where}{seen}"),
    Rule("link",       BROKEN,    TransportBroken,     "peer {p} lost the link {span} {where}{seen}"),
    Rule("absent",     PROTOCOL,  ProtocolError,       "peer {p} sent {to} a malformed {record} in {where}"),
    Rule("absent",     ANY,       CollectiveTimeout,   "rank(s) {who} did not arrive ({absent})"),
    Rule("descriptor", ANY,       CollectiveMismatch,  "collective mismatch: rank 0 called {ref} but rank {p} called {call}"),
    Rule("reported",   NONFINITE, NonFiniteError,      "rank {p} contributed {value!r} at element {index}"),
    Rule("result",     NONFINITE, NonFiniteError,      "the reduced sum overflowed although every input was finite"),
    Rule("reported",   TIMEOUT,   CollectiveTimeout,   "peer(s) {who} stopped responding (seen by rank(s) {seen})"),
    Rule("reported",   PROTOCOL,  CollectiveMismatch,  "during {where}: rank {p} received a frame of another "
                                                       "collective although every rank called {ref} (do "
                                                       "check_finite or segment_bytes differ between ranks?)"),
    Rule("own",        ANY,       GradcollError,       "its own error"),
)

#: A NONFINITE record in reduce_scatter's second round reports an overflowed chunk, not a bad input.
_CHUNK_OVERFLOW = ("the reduced sum overflowed to {value!r} at element {index} of rank {p}'s chunk"
                   " although every input was finite")


def verdict(coll: Coll, table: Sequence[Slot], seen: Seen, *, own: BaseException | None = None,
            marker: tuple[int, float] | None = None, overflow: bool = False) -> None:
    """Raise what the first matching row of ``VERDICT`` says, or return when no row matches (all is well).

    ``own`` is what this rank met on its data path, ``marker`` the first
    marker in its result (``_guard.first_marker``), and ``overflow`` says
    that NONFINITE records report overflowed chunks (reduce_scatter).
    """
    for rule in VERDICT:
        hits = _find(rule, table, own, marker)
        if hits:
            raise _error(coll, rule, hits, table, seen, own, marker, overflow)


def _find(rule: Rule, table: Sequence[Slot], own: BaseException | None,
          marker: tuple[int, float] | None) -> list[int]:
    """The slots that match ``rule``, in rank order (``[-1]`` for a finding of this rank's own)."""
    f, want = rule.finding, rule.status
    if f in ("own link", "own"):
        return [-1] if own is not None and (want == ANY or status_of(own) == want) else []
    if f == "result":
        return [-1] if marker is not None else []
    if f == "descriptor":
        return [p for p, s in enumerate(table) if s.desc() != table[0].desc()]
    absent = [p for p, s in enumerate(table) if not s.present and want in (ANY, s.status)]
    if f == "absent":
        return absent
    # A present record counts when it carries the status, and a link status only when it names the peer.
    reported = [p for p, s in enumerate(table) if s.present and s.status == want
                and (not STATUSES[want].names_peer or s.peer >= 0)]
    return reported if f == "reported" else sorted(absent + reported)  # "link": either


def _error(coll: Coll, rule: Rule, hits: list[int], table: Sequence[Slot], seen: Seen, own: BaseException | None,
           marker: tuple[int, float] | None, overflow: bool) -> BaseException:
    """The exception ``rule`` raises for ``hits``, in its words."""
    me, where, f = coll.rank, coll.where(), rule.finding
    if f in ("own link", "own"):
        assert own is not None
        return own  # in its own words, with the step
    if f == "result":
        index, value = marker or (-1, float("nan"))
        return _nonfinite(coll, None, index, value, rule.words + (f" (first at element {index})" if index >= 0 else ""))
    p, s = hits[0], table[hits[0]]
    if f == "link":
        culprit, witness = (s.peer, p) if s.present else (p, seen.collector)
        by = "" if witness is None else f" (seen by rank {witness})"
        words = rule.words.format(p=culprit, span=seen.span, where=where, seen=by)
        return cast("type[TransportError]", rule.raises)(f"rank {me}: {words}", rank=me, peer=culprit)
    if f == "absent" and rule.raises is CollectiveTimeout:
        who = ", ".join(map(str, hits))
        late = me in hits and seen.collector is not None
        return coll.timeout_error(hits, (seen.late if late else rule.words).format(who=who, absent=seen.absent))
    if f == "reported" and rule.status == TIMEOUT:
        stalled = sorted({table[q].peer for q in hits})
        by = ", ".join(str(q) for q, r in enumerate(table) if r.status == TIMEOUT)
        return coll.timeout_error(stalled, rule.words.format(who=", ".join(map(str, stalled)), seen=by))
    if f == "reported" and rule.status == NONFINITE:
        words = (_CHUNK_OVERFLOW if overflow else rule.words).format(p=p, value=s.value, index=s.index)
        return _nonfinite(coll, None if overflow else p, s.index, s.value, words)
    words = rule.words.format(p=p, to=seen.to, record=seen.record, where=where, ref=table[0].describe(),
                              call=s.describe())
    return rule.raises(f"rank {me}: {words}")


def _nonfinite(coll: Coll, contributor: int | None, index: int, value: float, what: str) -> NonFiniteError:
    """The NonFiniteError every rank raises: ``contributor`` is the bad input's rank (None: an overflow)."""
    return NonFiniteError(f"rank {coll.rank}: non-finite gradient in {coll.where()}: {what}; every rank halts",
                          contributor=contributor, index=index, value=value, rank=coll.rank, seq=coll.seq)
