"""The tag registry: every transport tag gradcoll's own traffic uses, by range and by phase.

Transport tags are shared by every layer that sends over one group's links,
so each layer owns a range and no other module picks a tag number. The
transport's bounds are its own (``LENIENT_TAG`` and ``MAX_TAG`` of
``gradcoll.transport.frame``): from ``LENIENT_TAG`` up a tag is *lenient*, a
mismatch there costs the frame and never the link. ``RANGES`` is the table
below, and docs/wire.md ("Tag ranges") shows the same one (a test holds the
two together):

| range | owner | lenient | tags |
| --- | --- | --- | --- |
| `0x00000000 .. 0x0FFFFFFF` | user point-to-point messages | no | any |
| `0x10000000 .. 0x3FFFFFFF` | front ends | no | node driver `0x3E000001` header, `0x3E000002` body |
| `0x40000000 .. 0x4FFFFFFF` | collectives after a handshake round | yes | `0x40000000 + (seq mod 2^20) * 256 + phase` |
| `0x50000000 .. 0x7EFFFFFF` | allreduces over lenient transports | yes | `0x50000000 + (hash(call, variant) mod 0x2F0000) * 256 + phase` |
| `0x7F000000 .. 0x7FFFFFFE` | agreement records | yes | `0x7F000001` handshake record, `0x7F000002` handshake table, `0x7F000003` error-path record |

A collective's *phase-0 tag* is a multiple of 256 and its phases (1..255)
fill the low byte, so every tag of a collective stays inside its range:

* ``seq_tag(seq)``: the collectives that agree in a handshake round first
  (broadcast, allgather, reduce_scatter, and every allreduce over a
  transport without lenient tags), from the sequence number mod ``2**20``;
* ``descriptor_tag(desc, variant)``: an allreduce over a lenient transport
  sends no round, so its tags carry a hash of its whole call (the handshake
  record's descriptor and the check_finite flag) and of its ``variant``
  (plain, deterministic, or low precision with its wire format): ranks whose
  calls differ in anything post different tags, which the transport reports
  as a mismatch. ``0x2F0000`` bases, so two different calls share one
  with a chance of about 1 in 3 million.

Phases, the low byte:

| phase | schedule |
| --- | --- |
| 1 | ring allreduce and reduce_scatter: every segment of both passes |
| 2, 3 | star allreduce: contributions up to rank 0, the result down |
| 4, 5, 6 | recursive-doubling allreduce: fold, butterfly rounds, unfold |
| 7 | broadcast |
| 8 | allgather |
| 9, 10 | two-level allreduce: inside each host, up to its leader and back down |
| 11, 12, 13, 14 | halving-doubling allreduce: fold, reduce-scatter rounds, allgather rounds, unfold |
| 1 .. 7 | raw-contribution schedules (low-precision and deterministic): reduce-scatter, allgather, up, down, fold, rounds, unfold |

The two-level allreduce's step between host leaders is the ring's (1) or
recursive doubling's (4, 5, 6) schedule under its own phase-0 tag. The
raw-contribution schedules reuse 1..7: their variant gives them phase-0
tags of their own, and the handshake before them (on transports without
lenient tags) has already agreed on what every rank runs.
"""

from __future__ import annotations

from typing import NamedTuple

from ..transport.frame import LENIENT_TAG, MAX_TAG

__all__ = [
    "RANGES", "TagRange", "seq_tag", "descriptor_tag", "PHASES",
    "NODE_HEADER", "NODE_BODY", "HANDSHAKE_UP", "HANDSHAKE_DOWN", "ALARM",
    "PLAIN", "DETERMINISTIC", "wire_variant",
]


class TagRange(NamedTuple):
    """One owner's tags, ``first .. last`` inclusive."""

    first: int
    last: int
    owner: str
    lenient: bool
    tags: str


SEQ_FIRST = LENIENT_TAG  # 0x40000000
DESCRIPTOR_FIRST = 0x50000000
DESCRIPTOR_LAST = 0x7EFFFFFF
AGREEMENT_FIRST = 0x7F000000

#: Strict tags of the node driver: a node message where a collective frame is due (or the reverse) drops the link.
NODE_HEADER, NODE_BODY = 0x3E000001, 0x3E000002
#: The handshake round: a record up to rank 0, the table down to everyone.
HANDSHAKE_UP, HANDSHAKE_DOWN = 0x7F000001, 0x7F000002
#: An allreduce error-path record (``gradcoll.algorithms._guard``). Not at the top of the range: the mpi
#: transport keeps the two tags below MPI's ``TAG_UB`` for its close and abort notices.
ALARM = 0x7F000003

RANGES = (
    TagRange(0, 0x0FFFFFFF, "user point-to-point messages", False, "any"),
    TagRange(0x10000000, LENIENT_TAG - 1, "front ends", False,
             "node driver `0x3E000001` header, `0x3E000002` body"),
    TagRange(SEQ_FIRST, DESCRIPTOR_FIRST - 1, "collectives after a handshake round", True,
             "`0x40000000 + (seq mod 2^20) * 256 + phase`"),
    TagRange(DESCRIPTOR_FIRST, DESCRIPTOR_LAST, "allreduces over lenient transports", True,
             "`0x50000000 + (hash(call, variant) mod 0x2F0000) * 256 + phase`"),
    TagRange(AGREEMENT_FIRST, MAX_TAG, "agreement records", True,
             "`0x7F000001` handshake record, `0x7F000002` handshake table, `0x7F000003` error-path record"),
)

_SEQ_MASK = (1 << 20) - 1
_DESCRIPTOR_BASES = (DESCRIPTOR_LAST + 1 - DESCRIPTOR_FIRST) >> 8  # 0x2F0000

#: Variants of an allreduce, folded into its descriptor tag so that their frames never meet.
PLAIN: tuple[int, ...] = ()
DETERMINISTIC = (0x44,)
_WIRE = 0x57


def wire_variant(code: int) -> tuple[int, ...]:
    """The variant of a low-precision allreduce whose wire format has ``code`` (bf16 1, fp16 2)."""
    return (_WIRE, code)


def seq_tag(seq: int) -> int:
    """The phase-0 tag of collective ``seq`` in the handshake-round range."""
    return SEQ_FIRST | ((seq & _SEQ_MASK) << 8)


def descriptor_tag(desc: tuple[int, ...], variant: tuple[int, ...] = PLAIN) -> int:
    """The phase-0 tag of an allreduce whose call is ``desc`` (descriptor and check_finite flag), in ``variant``."""
    # hash() of a tuple of ints is the same in every process (no hash randomisation for ints).
    return DESCRIPTOR_FIRST + ((hash(desc + variant) % _DESCRIPTOR_BASES) << 8)


# -- phases (the low byte) ---------------------------------------------------------------------
RING = 1
STAR_UP, STAR_DOWN = 2, 3
RD_FOLD, RD_ROUND, RD_UNFOLD = 4, 5, 6
BROADCAST = 7
ALLGATHER = 8
TWO_LEVEL_UP, TWO_LEVEL_DOWN = 9, 10
HD_FOLD, HD_RS, HD_AG, HD_UNFOLD = 11, 12, 13, 14
RAW_RS, RAW_AG, RAW_UP, RAW_DOWN, RAW_FOLD, RAW_ROUND, RAW_UNFOLD = range(1, 8)

#: Every schedule's phases, for the table above and its test.
PHASES: dict[str, tuple[int, ...]] = {
    "ring": (RING,),
    "star": (STAR_UP, STAR_DOWN),
    "recursive_doubling": (RD_FOLD, RD_ROUND, RD_UNFOLD),
    "broadcast": (BROADCAST,),
    "allgather": (ALLGATHER,),
    "two_level": (TWO_LEVEL_UP, TWO_LEVEL_DOWN),
    "halving_doubling": (HD_FOLD, HD_RS, HD_AG, HD_UNFOLD),
    "raw": (RAW_RS, RAW_AG, RAW_UP, RAW_DOWN, RAW_FOLD, RAW_ROUND, RAW_UNFOLD),
}
