"""The direct allreduce over the shared window: schedules, variants, zero copy, auto's choice.

Ranks are threads over the inproc transport (its window is ordinary
memory the threads share). The oracle is the star's bits: both sum in rank
order 0..n-1 and divide once, so the direct allreduce must equal it bit for
bit, whichever schedule, piece size or engine (compiled or Python) ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gradcoll.algorithms import ALLREDUCE, select_allreduce
from gradcoll.algorithms.deterministic import deterministic_allreduce
from gradcoll.algorithms.direct import alloc, direct_allreduce, direct_exact, direct_wire
from gradcoll.algorithms.low_precision import wire_allreduce
from gradcoll.errors import NonFiniteError, UsageError
from gradcoll.testing import gather_ranks
from gradcoll.transport.inproc import create_world
from tests.helpers import simd_widths

pytestmark = pytest.mark.timeout(120)

MODES = [None, "one-shot", "two-shot"]
OPS = ["mean", "sum", "max", "min"]


def each_rank(n: int, fn: Callable[[int, Any], Any], timeout: float = 20.0) -> list[Any]:
    ts = create_world(n, timeout=timeout)
    try:
        results, errors = gather_ranks(lambda r: fn(r, ts[r]), n)
    finally:
        for t in ts:
            t.close()
    for e in errors:
        if e is not None:
            raise e
    return results


def refill(buf: np.ndarray, data: np.ndarray) -> np.ndarray:
    """``buf`` holding ``data`` again (each call of a pair reduces the same input)."""
    buf[:] = data
    return buf


def star_bits(data: list[np.ndarray], op: str) -> bytes:
    bufs = [d.copy() for d in data]
    each_rank(len(data), lambda r, t: ALLREDUCE["star"](t, bufs[r], op=op, seq=1))
    return bufs[0].tobytes()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", range(1, 9))
def test_every_schedule_equals_the_star_bitwise(mode: str | None, n: int) -> None:
    rng = np.random.default_rng(n)
    for count in sorted({0, 1, max(n - 1, 0), n + 1, 1000, 300_007}):
        data = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
        want = star_bits(data, "mean")
        bufs = [d.copy() for d in data]
        # Twice: the first call builds the engine, the second takes the compiled engine.
        each_rank(n, lambda r, t: [direct_allreduce(t, refill(bufs[r], data[r]),
                                                    seq=s, mode=mode) for s in (1, 2)])
        assert all(b.tobytes() == want for b in bufs), (n, count, mode)


@pytest.mark.parametrize("op", ["max", "min", "sum", "mean"])
def test_float16_buffers_are_reduced_as_float16_values(op: str) -> None:
    """float16 data is widened to float32 on the window (its 16-bit variants carry wire values)."""
    n = 3
    data = [np.array([r + 1.0, -2.0 * r, 0.25, 1000.0 * r], np.float16) for r in range(n)]
    rows = np.stack([d.astype(np.float64) for d in data])
    want = {"max": rows.max(0), "min": rows.min(0), "sum": rows.sum(0), "mean": rows.mean(0)}[op].astype(np.float16)
    bufs = [d.copy() for d in data]
    each_rank(n, lambda r, t: [direct_allreduce(t, refill(bufs[r], data[r]), op=op, seq=s) for s in (1, 2)])
    for b in bufs:
        assert b.dtype == np.float16 and b.tobytes() == want.tobytes(), (op, b, want)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_op_and_dtype_through_the_python_steps_and_the_compiled_ones(op: str, dtype: Any) -> None:
    n, count = 4, 70_001
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    want = star_bits(data, op)
    for backend in (None, "numpy"):
        for mode in MODES:
            bufs = [d.copy() for d in data]
            each_rank(n, lambda r, t: direct_allreduce(t, bufs[r], op=op, seq=4, mode=mode, backend=backend))
            assert all(b.tobytes() == want for b in bufs), (backend, mode)


@pytest.mark.parametrize("mode", ["one-shot", "two-shot"])
def test_nonfinite_names_the_contributor_and_index_in_both_schedules(mode: str) -> None:
    n, count = 3, 200_000
    bufs = [np.ones(count, np.float32) for _ in range(n)]
    bufs[2][150_001] = np.inf
    ts = create_world(n, timeout=10)
    _, errors = gather_ranks(lambda r: direct_allreduce(ts[r], bufs[r], seq=9, mode=mode), n)
    for r, e in enumerate(errors):
        assert isinstance(e, NonFiniteError), (r, e)
        assert (e.contributor, e.index, e.seq) == (2, 150_001, 9), str(e)


def test_deterministic_on_the_window_equals_the_ring_bitwise() -> None:
    n, count = 5, 50_000
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal(count) * 10.0 ** rng.integers(-4, 5, count)).astype(np.float32) for _ in range(n)]
    out: dict[str, list[np.ndarray]] = {}
    for algo in ("ring", "direct"):
        bufs = out[algo] = [d.copy() for d in data]
        each_rank(n, lambda r, t: [deterministic_allreduce(t, refill(bufs[r], data[r]),
                                                           algorithm=algo, seq=s) for s in (1, 2)])
    assert all(b.tobytes() == out["ring"][0].tobytes() for b in out["direct"])


def mixed_contributions(n: int, count: int, seed: int) -> list[np.ndarray]:
    """Contributions whose elements take every lane of the exact kernel: within the grid's span (the float64
    sum), far apart (the grid), the special cases (only zeros, -0.0, subnormals, Inf and NaN)."""
    rng = np.random.default_rng(seed)
    data = [rng.standard_normal(count) for _ in range(n)]
    spread = rng.random(count) < 0.2
    for d in data:
        d[spread] *= 2.0 ** rng.integers(-60, 60, int(spread.sum()))
    data = [d.astype(np.float32) for d in data]
    zeros = rng.choice(count, count // 50, replace=False)
    for r, d in enumerate(data):
        d[zeros] = -0.0 if r % 2 else 0.0
        d[rng.choice(count, count // 100, replace=False)] = np.float32(1e-42)
        d[rng.choice(count, count // 200, replace=False)] = -np.float32(3e38) / n
    # +s, -s and a value k binades below with its last significand bit set, on both sides of the grid's
    # edge: the float64 sum keeps that bit, the grid rounds it off once k is past the span, and the
    # cancellation leaves it in the float32 result
    edge = rng.choice(count, 400 if n > 2 else 0, replace=False)
    s = np.float32(2.0) ** rng.integers(-20, 20, edge.size).astype(np.float32)
    k = rng.integers(20, 36, edge.size)
    for d in data:
        d[edge] = 0.0
    data[0][edge], data[1][edge] = s, -s
    data[min(2, n - 1)][edge] = (s * np.float32(2.0) ** -k.astype(np.float32)) * np.float32(1 + 2.0 ** -23)
    # sums beyond float32's range whose mean is in it, and sums whose mean falls below the smallest normal
    big, tiny = rng.choice(count, 40, replace=False), rng.choice(count, 200, replace=False)
    for r, d in enumerate(data):
        d[big] = np.float32(2e38) * np.float32(1 - r / 100)
        d[tiny] = (rng.standard_normal(tiny.size) * 2e-38).astype(np.float32)
    data[n - 1][rng.choice(count, 3, replace=False)] = np.inf
    data[0][rng.choice(count, 3, replace=False)] = np.nan
    return data


@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 9])  # 3-8: the loops with n a constant; 9: n as it comes
def test_deterministic_on_the_window_equals_the_numpy_reference_in_every_lane(n: int, op: str) -> None:
    from gradcoll.kernels import exact_reference
    count = 8 * 1237 + 5  # a tail after the 8-element groups
    data = mixed_contributions(n, count, seed=n)
    want = np.empty(count, np.float32)
    exact_reference.exact_reduce(data[0], np.stack(data[1:]), want, float(n) if op == "mean" else 1.0)
    for level in simd_widths("gradcoll.algorithms._direct_c"):  # the AVX-512, AVX2 and block forms this CPU has
        for mode in MODES:
            bufs = [d.copy() for d in data]
            each_rank(n, lambda r, t: direct_exact(t, bufs[r], op=op, check_finite=False, seq=1,
                                                   timeout=20.0, mode=mode))
            for b in bufs:
                assert b.tobytes() == want.tobytes(), (level, mode)


def sparse_contributions(n: int, count: int, seed: int) -> list[np.ndarray]:
    """Gradient-like contributions (within the grid's span almost everywhere) with a few elements of every
    other kind, each alone in its block of 64: the block test passes on most blocks, fails on those (far
    apart, subnormal next to normal, Inf, NaN), and a block whose sums leave float32's range passes it."""
    rng = np.random.default_rng(seed)
    data = [(rng.standard_normal(count) * 1e-3).astype(np.float32) for _ in range(n)]
    blocks = rng.permutation(count // 64)[:60] * 64 + rng.integers(0, 64, 60)
    far, sub, inf, nan, big, zero = np.split(blocks, 6)
    data[0][far] = data[0][far] * np.float32(2.0 ** -40)
    data[n - 1][sub] = np.float32(1e-42)
    data[1][inf] = np.inf
    data[n - 1][nan] = np.nan
    for r, d in enumerate(data):
        d[big] = np.float32(3e38) * np.float32(1 - r / 100)
        d[zero] = -0.0
    return data


@pytest.mark.parametrize("n", [3, 4, 5, 8, 9])
def test_deterministic_on_the_window_block_by_block(n: int) -> None:
    from gradcoll.kernels import exact_reference
    count = 64 * 300 + 13  # a tail after the blocks
    data = sparse_contributions(n, count, seed=n)
    for op in ("mean", "sum"):
        want = np.empty(count, np.float32)
        exact_reference.exact_reduce(data[0], np.stack(data[1:]), want, float(n) if op == "mean" else 1.0)
        for level in simd_widths("gradcoll.algorithms._direct_c"):
            bufs = [d.copy() for d in data]
            each_rank(n, lambda r, t: direct_exact(t, bufs[r], op=op, check_finite=False, seq=1, timeout=20.0,
                                                   mode="one-shot"))
            for b in bufs:
                assert b.tobytes() == want.tobytes(), (level, op)
    # a passing block whose sum leaves float32's range: every rank fails, at that element
    bufs = [np.full(count, 0.5 * (r + 1), np.float32) for r in range(n)]
    bufs[1][4097] = bufs[2][4097] = np.float32(3e38)
    ts = create_world(n, timeout=10)
    _, errors = gather_ranks(lambda r: direct_exact(ts[r], bufs[r], op="sum", check_finite=True, seq=2,
                                                    timeout=20.0, mode="one-shot"), n)
    for r, e in enumerate(errors):
        assert isinstance(e, NonFiniteError) and e.index == 4097, (r, e)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_wire_dtype_on_the_window(wire: str) -> None:
    n, count = 4, 30_000
    rng = np.random.default_rng(6)
    data = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    bufs = [d.copy() for d in data]
    each_rank(n, lambda r, t: [wire_allreduce(t, refill(bufs[r], data[r]), wire=wire,
                                              algorithm="direct", seq=s) for s in (1, 2)])
    ref = np.stack(data).astype(np.float64).mean(0)
    np.testing.assert_allclose(bufs[0], ref, rtol=2e-2, atol=2e-2)
    assert all(b.tobytes() == bufs[0].tobytes() for b in bufs)


def _wire_reference(data: list[np.ndarray], wire: str, op: str) -> np.ndarray:
    """The wire allreduce's bits: every contribution rounded to the wire, widened, summed in float32 in rank
    order (the last add divides for a mean), the result rounded to the wire and widened."""
    from gradcoll.kernels import lowp_reference as R
    n, count = len(data), data[0].size
    enc = np.empty(count, np.uint16)
    acc = np.empty(count, np.float32)
    for r, d in enumerate(data):
        R.lowp_encode(d, enc, wire, False)
        if r == 0:
            R.lowp_decode(enc, acc, wire)
        else:
            R.lowp_accumulate(acc, enc, wire, float(n) if op == "mean" and r == n - 1 else None, False)
    R.lowp_encode(acc, enc, wire, False)
    R.lowp_decode(enc, acc, wire)
    return acc


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])  # 2-4: the loops with n fixed; 5, 8: n as it comes
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_wire_dtype_on_the_window_has_the_reference_bits_at_every_vector_width(wire: str, n: int) -> None:
    count = 16 * 811 + 7  # a tail after the 16-lane groups
    rng = np.random.default_rng(n)
    data = [(rng.standard_normal(count) * np.exp2(rng.integers(-140, 120, count))).astype(np.float32)
            for _ in range(n)]
    for d in data:  # subnormals, zeros of both signs, halfway cases, values that round to Inf on the wire
        d[rng.choice(count, 40, replace=False)] = np.float32(1e-40)
        d[rng.choice(count, 40, replace=False)] = -0.0
        d[rng.choice(count, 40, replace=False)] = np.uint32(0x3F808000).view(np.float32)
        d[rng.choice(count, 10, replace=False)] = np.float32(3.4e38)
    for level in simd_widths("gradcoll.algorithms._direct_c"):
        for op in ("mean", "sum"):
            want = _wire_reference(data, wire, op)
            for mode in MODES[1:]:
                bufs = [d.copy() for d in data]
                each_rank(n, lambda r, t: direct_wire(t, bufs[r], wire=wire, op=op, check_finite=False, seq=1,
                                                      timeout=20.0, mode=mode))
                for b in bufs:
                    assert b.tobytes() == want.tobytes(), (level, op, mode)


#: NaNs whose number rounding to bf16 goes wrong (0x7fffffff gives -0.0, 0xffffffff gives 0.0), a signalling
#: NaN of each sign, the default quiet NaN, and both infinities
NAN_BITS = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000, 0xFF800000]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_wire_dtype_on_the_window_keeps_every_nan_and_inf_in_every_lane(wire: str, n: int) -> None:
    """Each rank's NaNs and Infs sit where no other rank has one, in the share another rank reduces and in
    its own (which two-shot reads from the float32 buffer and rounds in the reduction): the bits are the
    reference's, at every vector width."""
    count = 16 * 601 + 5
    rng = np.random.default_rng(11 + n)
    data = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    spots = rng.permutation(count)[: n * 70].reshape(n, 70)
    for r, d in enumerate(data):
        d.view(np.uint32)[spots[r]] = np.resize(np.array(NAN_BITS, np.uint32), 70)
    want = _wire_reference(data, wire, "mean")
    for level in simd_widths("gradcoll.algorithms._direct_c"):
        for mode in MODES[1:]:
            bufs = [d.copy() for d in data]
            each_rank(n, lambda r, t: direct_wire(t, bufs[r], wire=wire, op="mean", check_finite=False, seq=1,
                                                  timeout=20.0, mode=mode))
            for b in bufs:
                assert b.tobytes() == want.tobytes(), (level, mode)


@pytest.mark.parametrize("bits", [0xFFFFFFFF, 0x7FFFFFFF])
def test_a_nan_in_a_ranks_own_share_halts_the_wire_allreduce_at_every_vector_width(bits: int) -> None:
    n, count = 3, 90_000
    at = count // 2 + 17  # in rank 1's share of the two-shot
    for level in simd_widths("gradcoll.algorithms._direct_c"):
        bufs = [np.ones(count, np.float32) for _ in range(n)]
        bufs[1].view(np.uint32)[at] = bits
        ts = create_world(n, timeout=10)
        try:
            _, errors = gather_ranks(lambda r: direct_wire(ts[r], bufs[r], wire="bf16", op="mean", seq=5,
                                                           check_finite=True, timeout=10.0, mode="two-shot"), n)
        finally:
            for t in ts:
                t.close()
        for r, e in enumerate(errors):
            assert isinstance(e, NonFiniteError), (level, r, e)
            assert (e.contributor, e.index, e.seq) == (1, at, 5), (level, str(e))


def test_alloc_reduces_in_place_without_a_copy_in() -> None:
    n, count = 3, 100_003

    def rank(r: int, t: Any) -> tuple[bytes, bool]:
        arr = alloc(t, count, np.float32)
        assert arr.shape == (count,) and not arr.any()
        win = t.shared_window.cache["regions"][0]
        assert np.shares_memory(arr, win.slot(r))
        arr[:] = np.arange(count, dtype=np.float32) * (r + 1)
        direct_allreduce(t, arr, op="sum", seq=1)
        part = arr[10:5000]  # a part at the same offset on every rank
        part[:] = r
        direct_allreduce(t, part, op="max", seq=2)
        return arr.tobytes(), bool((part == n - 1).all())

    results = each_rank(n, rank)
    want = np.arange(count, dtype=np.float32) * np.float32(sum(range(1, n + 1)))
    want[10:5000] = n - 1
    assert all(b == want.tobytes() and ok for b, ok in results)


def test_alloc_buffers_take_the_hot_path_of_their_region_and_offset() -> None:
    n, count = 2, 4096

    def rank(r: int, t: Any) -> tuple[list[bool], list[Any]]:
        arr = alloc(t, count, np.float32)
        plain = np.empty(count, np.float32)
        part = arr[64:64 + 1000]
        ok = []
        for s in range(4):  # the first call of each builds its engine; the later ones run the engine's path
            for b, base in ((arr, 1.0), (plain, 2.0), (part, 3.0)):
                b[:] = np.float32(base * (r + 1) + s)
                direct_allreduce(t, b, op="sum", seq=3 * s + int(base))
                ok.append(bool((b == np.float32(base * 3 + 2 * s)).all()))
            ok.append(bool((arr[64:1064] == np.float32(9 + 2 * s)).all() and (arr[:64] == 3 + 2 * s).all()))
        return ok, list(t.shared_window.cache["window-run"].fast)

    for ok, keys in each_rank(n, rank):
        assert all(ok), ok
        if keys:  # the compiled engine: the region's two offsets and the plain buffer each have a hot engine
            assert sorted(k[2] for k in keys if isinstance(k, tuple)) == [0, 64 * 4]
            assert any(isinstance(k, int) for k in keys)


def test_alloc_checks_its_shape() -> None:
    with pytest.raises(UsageError):
        each_rank(2, lambda r, t: alloc(t, (-1, 3), np.float32))


def test_auto_picks_direct_where_memory_is_shared() -> None:
    for size in (2, 4, 8):
        for nbytes in (4 << 10, 256 << 10, 4 << 20, 64 << 20):
            assert select_allreduce(nbytes, size, "shm", shared_memory=True) == "direct"
            assert select_allreduce(nbytes, size, "tcp", shared_memory=False) != "direct"
    assert select_allreduce(4 << 10, 1, "shm", shared_memory=True) != "direct"  # nothing to share
