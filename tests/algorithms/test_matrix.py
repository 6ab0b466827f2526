"""The allreduce combination matrix (issue 47): transport x algorithm x op x dtype x wire x deterministic x count x world.

Every combination of ``ProcessGroup.allreduce(buf, op=, algorithm=, check_finite=True, wire_dtype=, deterministic=)``
must either give the right answer (against a float64 NumPy reference) with the same bits on every rank, and under
``deterministic=True`` the same bits under every algorithm that ran the same inputs; or raise ``UsageError`` (the
same class) on every rank and leave the group usable: a follow-up plain allreduce succeeds and nothing is poisoned.
Anything else (another error, ranks that disagree, a hang, a poisoned group) is a failure.

Ranks are threads over real transports (inproc, tcp on 127.0.0.1, shm), one group per transport and world size,
reused across combinations and rebuilt only after one poisons it. The algorithms are read from
``gradcoll.algorithms.ALLREDUCE`` at run time. A *cell* (op, dtype, wire, deterministic, count) runs every algorithm
on the same inputs in turn. By default a seeded sample runs: every algorithm under every (wire_dtype, deterministic)
variant at least once on tcp and on shm, plus ``GRADCOLL_MATRIX_CELLS`` (4) random cells per group; ``GRADCOLL_MATRIX_SEED``
picks another sample, and ``GRADCOLL_MATRIX=full`` (``make matrix``) runs all of it. Failures are collected per group
and listed by cause.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import ALLREDUCE
from gradcoll.algorithms.ring import SEGMENT_BYTES
from gradcoll.errors import UsageError
from gradcoll.group import ProcessGroup
from gradcoll.testing import threaded_group
from gradcoll.transport import inproc, shm, tcp
from gradcoll.transport.base import Transport

FULL = os.environ.get("GRADCOLL_MATRIX", "") == "full"
SEED = int(os.environ.get("GRADCOLL_MATRIX_SEED", "47"))
SAMPLE = int(os.environ.get("GRADCOLL_MATRIX_CELLS", "4"))  # random cells per group in the sample
CREATE: dict[str, Callable[..., Transport]] = {"inproc": inproc.create, "tcp": tcp.create, "shm": shm.create}
OPTIONS: dict[str, dict[str, Any]] = {"shm": {"ring_bytes": 1 << 16}}  # as the other shm tests
WORLDS = (1, 2, 3, 4, 5)
OPS = ("mean", "sum", "max", "min")
DTYPES = ("float32", "float64")
WIRES: tuple[str | None, ...] = (None, "bf16", "fp16")
DETS = (False, True)
COVERED = ("tcp", "shm")  # the sample runs every algorithm x variant on these
TIMEOUT = 20.0  # every call's own bound; a rank still running JOIN seconds after it started hangs
JOIN = TIMEOUT + 15.0
UNIT = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # the wire formats' unit roundoff

pytestmark = [pytest.mark.matrix, pytest.mark.timeout(3600 if FULL else 180)]


def algorithms() -> list[str]:
    return ["auto", *ALLREDUCE]


def counts(dtype: str) -> tuple[int, ...]:
    """Empty, one, a few, odd, and one past a ring segment."""
    return (0, 1, 7, 4097, SEGMENT_BYTES // np.dtype(dtype).itemsize + 3)


@dataclass(frozen=True)
class Cell:
    """One set of inputs and arguments; every algorithm runs it in turn."""

    op: str
    dtype: str
    wire: str | None
    det: bool
    count: int

    @property
    def variant(self) -> str:
        return "+".join(([f"wire={self.wire}"] if self.wire else []) + (["det"] if self.det else [])) or "plain"


def all_cells() -> list[Cell]:
    return [Cell(op, dt, w, d, c) for op, dt, w, d in itertools.product(OPS, DTYPES, WIRES, DETS) for c in counts(dt)]


def plan() -> dict[tuple[str, int], list[Cell]]:
    """The cells each (transport, world size) runs: all of them, or the seeded sample."""
    keys = [(t, n) for t in CREATE for n in WORLDS]
    if FULL:
        return {k: all_cells() for k in keys}
    rng = random.Random(SEED)
    cells = all_cells()
    out: dict[tuple[str, int], list[Cell]] = {k: rng.sample(cells, min(SAMPLE, len(cells))) for k in keys}
    for t, wire, det in itertools.product(COVERED, WIRES, DETS):
        # Arguments the variant takes (float32, mean or sum where it is precise), so it runs rather than refuses;
        # wire and deterministic together are refused by design, and checked as such.
        precise = wire is not None or det
        dt = "float32" if wire else rng.choice(DTYPES)
        cell = Cell(rng.choice(OPS[:2] if precise else OPS), dt, wire, det, rng.choice(counts(dt)))
        out[(t, rng.choice(WORLDS[1:]))].append(cell)
    return out


PLAN = plan()


# -- ranks as threads, with bounded joins ----------------------------------------------------------------------------
def on_threads(fn: Callable[[int], Any], n: int, join: float = JOIN) -> tuple[list[Any], list[BaseException | None], list[int]]:
    """Run ``fn(rank)`` on ``n`` daemon threads; every rank's result and error, and the ranks still running after ``join``."""
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"matrix-rank-{r}") for r in range(n)]
    for th in threads:
        th.start()
    end = time.monotonic() + join  # one budget for all the joins
    for th in threads:
        th.join(max(0.0, end - time.monotonic()))
    return results, errors, [r for r, th in enumerate(threads) if th.is_alive()]


class World:
    """One group of ``n`` ranks over ``transport``, rebuilt after a combination broke it."""

    def __init__(self, transport: str, n: int) -> None:
        self.transport, self.n = transport, n
        self.groups: list[ProcessGroup] = []
        self.rebuilds = 0
        self.build()

    def build(self) -> None:
        made = threaded_group(CREATE[self.transport], self.n, timeout=TIMEOUT, **OPTIONS.get(self.transport, {}))
        self.groups = [ProcessGroup(t, timeout=TIMEOUT) for t in made]

    def close(self) -> None:
        groups, self.groups = self.groups, []
        on_threads(lambda r: groups[r].close(), len(groups))

    def rebuild(self) -> None:
        self.close()
        self.build()
        self.rebuilds += 1

    def poisoned(self) -> list[int]:
        return [r for r, g in enumerate(self.groups) if g.poisoned]

    def run(self, fn: Callable[[ProcessGroup, int], Any]) -> tuple[list[Any], list[BaseException | None], list[int]]:
        groups = self.groups
        return on_threads(lambda r: fn(groups[r], r), self.n)


# -- judging one combination ------------------------------------------------------------------------------------------
def describe(e: BaseException) -> str:
    """An error's class and message, without rank numbers and other counts, so that equal causes group together."""
    msg = re.sub(r"\brank \d+: ", "", str(e))
    msg = re.sub(r"\b\d+\b", "#", msg)
    return f"{type(e).__name__}: {msg[:120]}"


def inputs(cell: Cell, n: int) -> list[np.ndarray]:
    """Each rank's buffer: normal floats, seeded by rank and count, |x| < 100 (no fp16 overflow at 5 ranks)."""
    return [np.clip(np.random.default_rng([SEED, r, cell.count]).normal(0.0, 10.0, cell.count), -99, 99).astype(cell.dtype)
            for r in range(n)]


def check_value(cell: Cell, data: list[np.ndarray], got: np.ndarray) -> str | None:
    """None when ``got`` is the reduction of ``data`` within the bound of ``cell``'s arithmetic, else what is wrong."""
    n = len(data)
    if got.dtype != np.dtype(cell.dtype) or got.shape != (cell.count,):
        return f"wrong dtype or shape: {got.dtype} {got.shape}"
    rows = np.stack([d.astype(np.float64) for d in data])
    g = got.astype(np.float64)
    wire_tol = 0.0 if cell.wire is None else (2 * n + 2) * 2.0**-24  # fp16's subnormal spacing, per rounding
    if cell.op in ("max", "min"):  # exact; through a wire, the rounded extreme (rounding is monotonic)
        ref = rows.max(0) if cell.op == "max" else rows.min(0)
        tol = np.zeros_like(ref) if cell.wire is None else 2 * UNIT[cell.wire] * np.abs(ref) + wire_tol
    else:
        mag = np.abs(rows).sum(0)
        info = np.finfo(cell.dtype)
        tol = (n + 1) * float(info.eps) * mag + float(info.tiny)  # the order of the float sums, the mean's division
        if cell.wire:  # each contribution rounded to the wire once, the result once more
            tol = tol + 3 * UNIT[cell.wire] * mag + wire_tol
        if cell.det:  # each contribution on a grid of 2**(E-F), max|x| < 2**E (gradcoll.kernels.exact_reference)
            _, e = np.frexp(np.abs(rows).max(0) if n else mag)
            tol = tol + n * np.ldexp(1.0, e - min(51, 52 - (n - 1).bit_length()))
        ref = rows.sum(0)
        if cell.op == "mean":
            ref, tol = ref / n, tol / n
    err = np.abs(g - ref)
    bad = np.flatnonzero(~(err <= tol))
    if not bad.size:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = err[bad] / tol[bad]
    i = bad[np.argmax(np.nan_to_num(ratio, nan=np.inf))]
    return f"{bad.size} wrong, worst [{i}] {g[i]:.17g} for {ref[i]:.17g}, err {err[i]:.3g} > tol {tol[i]:.3g}"


def still_usable(world: World) -> str | None:
    """None when the group survived: nothing poisoned and a plain allreduce still gives the right answer."""
    if poisoned := world.poisoned():
        return f"left the group poisoned (ranks {poisoned})"
    want = world.n * (world.n - 1) / 2
    results, errors, hung = world.run(lambda g, r: g.allreduce(np.full(4, r, np.float32), op="sum", timeout=TIMEOUT))
    if hung:
        return f"then a plain allreduce hung on ranks {hung}"
    if raised := sorted({describe(e) for e in errors if e is not None}):
        return f"then a plain allreduce raised {' | '.join(raised)}"
    if any(not np.array_equal(x, np.full(4, want, np.float32)) for x in results):
        return "then a plain allreduce gave a wrong answer"
    return None


def run_combo(world: World, algo: str, cell: Cell, data: list[np.ndarray]) -> tuple[str | None, str, bytes | None]:
    """Run one combination on ``world``: (what failed or None, a note on the value, the result's bits on success).

    The group is rebuilt where the combination broke it.
    """
    bufs = [d.copy() for d in data]
    _, errors, hung = world.run(lambda g, r: g.allreduce(bufs[r], op=cell.op, algorithm=algo, check_finite=True,
                                                         wire_dtype=cell.wire, deterministic=cell.det, timeout=TIMEOUT))
    cause: str | None = None
    broken = bool(hung)  # the group must be rebuilt (a poisoned one is, too)
    if hung:
        cause = f"hang: ranks {hung} still running after {JOIN:.0f} s"
    elif all(isinstance(e, UsageError) for e in errors):  # refused everywhere: fine if the group is still usable
        kinds = sorted({type(e).__name__ for e in errors})
        cause = f"UsageError of different classes on different ranks: {kinds}" if len(kinds) > 1 else None
        first = errors[0]
        if cause is None and first is not None and (unusable := still_usable(world)):
            cause, broken = f"{describe(first)} -- but it {unusable}", True
        if cause is None:
            return None, "", None
    elif any(e is not None for e in errors):
        raised = sorted({describe(e) for e in errors if e is not None})
        returned = [r for r, e in enumerate(errors) if e is None]
        cause = ("ranks disagree: " if returned or len(raised) > 1 else "") + " | ".join(raised)
        if returned:
            cause += f" while ranks {returned} returned"
    elif poisoned := world.poisoned():
        cause = f"returned, but ranks {poisoned} are poisoned"
    elif any(b.tobytes() != bufs[0].tobytes() for b in bufs[1:]):
        cause = "ranks returned different bits"
    elif wrong := check_value(cell, data, bufs[0]):
        return "wrong value", wrong, None
    else:
        return None, "", bufs[0].view(f"u{bufs[0].itemsize}").tobytes()
    if poisoned := world.poisoned():
        cause += "" if "poisoned" in cause else f" (group poisoned on ranks {poisoned})"
    if broken or poisoned:
        world.rebuild()
    return cause, "", None


@dataclass
class Failure:
    cause: str
    algo: str
    cell: Cell
    note: str = ""


def run_cell(world: World, cell: Cell, failures: list[Failure]) -> int:
    """Every algorithm on ``cell``'s inputs, then the deterministic cross-check; returns how many combinations ran."""
    data = inputs(cell, world.n)
    bits: dict[str, bytes] = {}
    algos = algorithms()
    for algo in algos:
        cause, note, got = run_combo(world, algo, cell, data)
        if cause is not None:
            failures.append(Failure(cause, algo, cell, note))
        elif got is not None:
            bits[algo] = got
    if cell.det and len(set(bits.values())) > 1:
        classes: dict[bytes, list[str]] = defaultdict(list)
        for algo, b in bits.items():
            classes[b].append(algo)
        split = " | ".join(",".join(c) for c in sorted(classes.values()))
        failures.append(Failure(f"deterministic bits differ between algorithms: {split}", "*", cell))
    return len(algos)


def report(title: str, failures: list[Failure]) -> str:
    """The failures grouped by cause, then by algorithm and variant, listing op/dtype[counts] compactly."""
    table: dict[str, dict[tuple[str, str], dict[tuple[str, str], list[str]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for f in failures:
        table[f.cause][(f.algo, f.cell.variant)][(f.cell.op, f.cell.dtype)].append(
            f"{f.cell.count}" + (f" ({f.note})" if f.note else ""))
    lines = [title]
    for cause in sorted(table):
        rows = table[cause]
        lines.append(f"  {sum(len(c) for w in rows.values() for c in w.values())} x {cause}")
        for (algo, variant), where in sorted(rows.items()):
            what = "  ".join(f"{op}/{dt}[{', '.join(cs)}]" for (op, dt), cs in sorted(where.items()))
            lines.append(f"      {algo} {variant}: {what}")
    return "\n".join(lines)


# -- the tests --------------------------------------------------------------------------------------------------------
def test_sample_covers_every_algorithm_and_variant() -> None:
    """The sample runs every algorithm (each cell runs them all) under every variant on tcp and on shm."""
    for t in COVERED:
        seen = {(c.wire, c.det) for n in WORLDS for c in PLAN[(t, n)]}
        assert seen == set(itertools.product(WIRES, DETS)), (t, seen)
    assert len(algorithms()) == len(set(algorithms())) > 1


@pytest.mark.parametrize(("transport", "n"), list(PLAN))
def test_allreduce_matrix(transport: str, n: int) -> None:
    cells = PLAN[(transport, n)]
    world = World(transport, n)
    failures: list[Failure] = []
    ran = 0
    try:
        for cell in cells:
            try:
                ran += run_cell(world, cell, failures)
            except Exception as e:  # noqa: BLE001 - a group that could not be rebuilt ends the run, with what it found
                failures.append(Failure(f"stopped the run: {describe(e)}", "*", cell))
                break
    finally:
        world.close()
    failed = len({(f.algo, f.cell) for f in failures})
    title = (f"{transport}, {n} ranks: {failed} of {ran} combinations failed ({len(cells)} cells x {len(algorithms())}"
             f" algorithms; group rebuilt {world.rebuilds} times):")
    assert not failures, report(title, failures)
