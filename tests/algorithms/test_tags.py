"""The one tag registry (gradcoll/algorithms/tags.py): ranges that tile the tag space, phases inside them, one doc."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gradcoll.algorithms import tags
from gradcoll.node import wire as node_wire
from gradcoll.transport.frame import LENIENT_TAG, MAX_TAG

ROOT = Path(__file__).resolve().parents[2]


def rendered() -> list[str]:
    """The registry's RANGES as the Markdown rows docs/wire.md and the module docstring show."""
    return [f"| `0x{r.first:08X} .. 0x{r.last:08X}` | {r.owner} | {'yes' if r.lenient else 'no'} | {r.tags} |"
            for r in tags.RANGES]


def range_of(tag: int) -> tags.TagRange:
    (r,) = [r for r in tags.RANGES if r.first <= tag <= r.last]
    return r


def test_ranges_tile_the_tag_space_without_overlap() -> None:
    assert tags.RANGES[0].first == 0 and tags.RANGES[-1].last == MAX_TAG
    for a, b in zip(tags.RANGES, tags.RANGES[1:], strict=False):
        assert a.first <= a.last < b.first == a.last + 1, (a, b)
    for r in tags.RANGES:  # lenient exactly from the transport's boundary up
        assert r.lenient == (r.first >= LENIENT_TAG) and (r.last < LENIENT_TAG or r.first >= LENIENT_TAG), r


def test_named_tags_sit_in_their_ranges_and_keep_their_values() -> None:
    assert (node_wire.HEADER_TAG, node_wire.BODY_TAG) == (tags.NODE_HEADER, tags.NODE_BODY) == (0x3E000001, 0x3E000002)
    assert range_of(tags.NODE_HEADER).owner == range_of(tags.NODE_BODY).owner == "front ends"
    assert (tags.HANDSHAKE_UP, tags.HANDSHAKE_DOWN, tags.ALARM) == (0x7F000001, 0x7F000002, 0x7F000003)
    for t in (tags.HANDSHAKE_UP, tags.HANDSHAKE_DOWN, tags.ALARM):
        assert range_of(t).owner == "agreement records"
        assert t <= 2**31 - 3  # the mpi transport keeps TAG_UB - 1 and TAG_UB (2**31 - 1 in Open MPI) for itself
    assert tags.seq_tag(0) == LENIENT_TAG and tags.seq_tag(118) + tags.RING == LENIENT_TAG | 118 << 8 | 1


def test_phases_fill_the_low_byte_and_differ_within_a_schedule() -> None:
    for name, phases in tags.PHASES.items():
        assert all(1 <= p <= 255 for p in phases), name
        assert len(set(phases)) == len(phases), name
    plain = tags.PHASES["ring"] + tags.PHASES["star"] + tags.PHASES["recursive_doubling"]
    assert len(set(plain)) == len(plain)  # the plain allreduces never reuse each other's phases
    seq_only = tags.PHASES["broadcast"] + tags.PHASES["allgather"]
    assert not set(seq_only) & set(plain)


@given(st.integers(-(2**40), 2**40))
def test_every_seq_tag_and_phase_stays_in_its_range(seq: int) -> None:
    tag0 = tags.seq_tag(seq)
    assert tag0 % 256 == 0
    assert range_of(tag0) is range_of(tag0 + 255) is tags.RANGES[2]


@given(st.lists(st.integers(-(2**63), 2**63), min_size=1, max_size=10), st.booleans())
def test_every_descriptor_tag_and_phase_stays_in_its_range(desc: list[int], check: bool) -> None:
    for variant in (tags.PLAIN, tags.DETERMINISTIC, tags.wire_variant(1), tags.wire_variant(2)):
        tag0 = tags.descriptor_tag(tuple(desc) + (check,), variant)
        assert tag0 % 256 == 0
        assert range_of(tag0) is range_of(tag0 + 255) is tags.RANGES[3]


def test_variants_and_calls_get_their_own_tags() -> None:
    desc = (1, 1, 1, ord("f"), 4, -1, 10, 5, True)
    variants = (tags.PLAIN, tags.DETERMINISTIC, tags.wire_variant(1), tags.wire_variant(2))
    assert len({tags.descriptor_tag(desc, v) for v in variants}) == len(variants)
    calls = {desc[:6] + (count, seq, check) for count in range(50) for seq in range(20) for check in (False, True)}
    assert len({tags.descriptor_tag(d) for d in calls}) == len(calls)


def test_docs_and_docstring_show_the_registry() -> None:
    doc = (ROOT / "docs" / "wire.md").read_text()
    section = doc[doc.index("## Tag ranges"): doc.index("\n## ", doc.index("## Tag ranges") + 1)]
    shown = [line for line in section.splitlines() if line.startswith("| `0x")]
    assert shown == rendered()
    assert [line for line in (tags.__doc__ or "").splitlines() if line.startswith("| `0x")] == rendered()


def test_docstring_phase_table_is_the_registry() -> None:
    rows = re.findall(r"^\| ([\d ,.]+) \| ", tags.__doc__ or "", re.M)

    def numbers(cell: str) -> tuple[int, ...]:
        if ".." in cell:
            a, b = cell.split("..")
            return tuple(range(int(a), int(b) + 1))
        return tuple(int(x) for x in cell.split(","))

    assert [numbers(c) for c in rows] == list(tags.PHASES.values())


# Not transport tags: the coordinator protocol's message-type bytes, which travel in its own framing.
OTHER_TAGS = {"gradcoll/coordinator/messages.py"}


def test_no_other_module_assigns_a_tag_number() -> None:
    """Outside the registry (and the transports, which own their bounds), no module constant named TAG or PHASE is a number."""
    offenders = []
    for path in sorted((ROOT / "gradcoll").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "gradcoll/algorithms/tags.py" or rel.startswith("gradcoll/transport/") or rel in OTHER_TAGS:
            continue
        for node in ast.parse(path.read_text()).body:  # module constants
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                    isinstance(v, ast.Constant) and type(v.value) is int for v in ast.walk(node.value)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n.id if isinstance(n, ast.Name) else n.attr for t in targets for n in ast.walk(t)
                         if isinstance(n, (ast.Name, ast.Attribute))]
                offenders += [f"{rel}:{node.lineno} {n}" for n in names if re.search(r"TAG|PHASE", n)]
    assert not offenders, offenders
