"""The one-pass kernels (``_fused.h``, ``numba_cpu``, ``numba_lowp``): every code path gives the reference's bits.

The compiled loops have a vector body, a scalar tail, a non-temporal store path, an exact-reciprocal finish
and hardware fp16 conversions; the Numba loops have several passes for many inputs and a threaded version.
Each is driven here across its boundaries and compared bit for bit with the NumPy reference.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import gradcoll
from gradcoll import kernels as K
from gradcoll.kernels import lowp_reference as R
from gradcoll.kernels import numba_lowp, reference
from tests.helpers import simd_widths

HOST = [b for b in K.available_backends() if b in ("numba", "cython")]
needs_ext = pytest.mark.skipif("cython" not in HOST, reason="needs the compiled extension (pip install -e . with a C compiler)")


def ref_reduce(rows: list[np.ndarray], divisor: float, acc=None) -> np.ndarray:
    acc_dt = np.dtype(acc or rows[0].dtype)
    out = np.empty(rows[0].shape, acc_dt)
    reference.reduce_rows(rows, out, acc_dt, divisor, False)
    return out


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_length_and_input_count(backend: str, dtype: type) -> None:
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 70):  # 2-8: the compiled loop with n a constant
        for m in (0, 1, 7, 31, 32, 33, 63, 64, 65, 127, 129, 1000):
            rows = [rng.standard_normal(m).astype(dtype) for _ in range(n)]
            for op, divisor in (("mean", n), ("sum", 1)):
                want = ref_reduce(rows, divisor)
                assert K.mean_reduce(rows, op=op, backend=backend).tobytes() == want.tobytes(), (n, m, op)
                assert K.mean_reduce(np.stack(rows) if m else rows, op=op, backend=backend).tobytes() == want.tobytes()
            for d in (None, n, 3):  # the ring's step over the same lengths: vector body, scalar tail
                want = rows[0].copy()
                reference.accumulate(want, rows[-1], None, d, False)
                got = rows[0].copy()
                K.accumulate(got, rows[-1], divide_by=d, check_finite=False, backend=backend)
                assert got.tobytes() == want.tobytes(), (n, m, d)


@pytest.mark.skipif("cython" not in K.available_backends(), reason="the compiled extension is not built")
def test_compiled_accumulate_at_every_vector_width() -> None:
    """The AVX-512, AVX2 and scalar accumulate loops (as many as this CPU has; the widest runs first and the
    next takes what is left): the reference's bits for every mode and a scale, subnormal results included,
    and a non-finite result caught wherever it lands (in each loop's part and the tail)."""
    from gradcoll.errors import NonFiniteError
    rng = np.random.default_rng(12)
    tiny = np.finfo(np.float32).smallest_normal
    for level in simd_widths("gradcoll.kernels._cython_kernels"):
        for m in (0, 1, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 1000, 4099):
            for mag in (1.0, tiny * 8):
                a = (rng.standard_normal(m) * mag).astype(np.float32)
                b = (rng.standard_normal(m) * mag).astype(np.float32)
                for scale, d in ((None, None), (None, 4), (None, 3), (0.3, None), (0.3, 3), (0.5, 8)):
                    want = a.copy()
                    reference.accumulate(want, b, scale, d, False)
                    got = a.copy()
                    K.accumulate(got, b, scale=scale, divide_by=d, check_finite=False, backend="cython")
                    assert got.tobytes() == want.tobytes(), (level, m, mag, scale, d)
            for at in {0, m // 2, m - 33, m - 17, m - 1} if m else ():
                if at < 0:
                    continue
                for bad in (np.nan, np.inf, -np.inf):
                    x = np.ones(m, np.float32)
                    x[at] = bad
                    with pytest.raises(NonFiniteError) as ei:
                        K.accumulate(np.ones(m, np.float32), x, backend="cython")
                    assert ei.value.index == at, (level, m, at)


@pytest.mark.parametrize("backend", HOST)
def test_divisors_exact_reciprocal_or_divide(backend: str) -> None:
    """Powers of two multiply by the reciprocal (same bits), others divide; subnormal results included."""
    rng = np.random.default_rng(4)
    tiny = np.finfo(np.float32).smallest_normal
    for scale in (1.0, tiny * 8):  # the second: every result subnormal or near it
        a = (rng.standard_normal(999) * scale).astype(np.float32)
        b = (rng.standard_normal(999) * scale).astype(np.float32)
        for d in (2, 3, 4, 6, 8, 0.5, 1024, 2.0**100):
            want = a.copy()
            reference.accumulate(want, b, None, d, False)
            got = a.copy()
            K.accumulate(got, b, divide_by=d, check_finite=False, backend=backend)
            assert got.tobytes() == want.tobytes(), (scale, d)
        for n in (2, 3, 4, 8):  # mean of n rows: multiply by 1/n for 2, 4, 8; divide for 3
            rows = [(rng.standard_normal(999) * scale).astype(np.float32) for _ in range(n)]
            assert K.mean_reduce(rows, backend=backend).tobytes() == ref_reduce(rows, n).tobytes(), (scale, n)


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_anywhere_is_caught_and_located(backend: str, dtype: type) -> None:
    """In the vector body and the scalar tail, in every input, with one pass and with several."""
    rng = np.random.default_rng(5)
    for n in (2, 9):
        m = 77
        for where in (0, 31, 32, 63, 64, 76):
            for who in (0, n - 1):
                for bad in (np.nan, np.inf, -np.inf):
                    x = rng.standard_normal((n, m)).astype(dtype)
                    x[who, where] = bad
                    for inputs in (list(x), x):
                        with pytest.raises(gradcoll.NonFiniteError) as ei:
                            K.mean_reduce(inputs, backend=backend)
                        assert (ei.value.contributor, ei.value.index) == (who, where)
                    acc = x[1 - who if n == 2 else 0].copy() if who else x[0].copy()
                    with pytest.raises(gradcoll.NonFiniteError):
                        K.accumulate(acc, x[who], backend=backend)
                    with pytest.raises(gradcoll.NonFiniteError) as ei:
                        K.check_finite(x[who], backend=backend)
                    assert ei.value.index == where


@needs_ext
def test_non_temporal_stores_give_the_same_bits() -> None:
    from gradcoll.kernels._compiled import extension

    ext = extension()
    rng = np.random.default_rng(6)
    before = ext.STREAM_BYTES
    try:
        for nbytes in (0, 1 << 62):
            ext.set_stream_bytes(nbytes)
            for m in (1, 100, 4099):
                rows = [rng.standard_normal(m).astype(np.float32) for _ in range(3)]
                want = ref_reduce(rows, 3)
                assert K.mean_reduce(rows, backend="cython").tobytes() == want.tobytes()
                buf = np.empty(m + 1, np.float32)
                out = buf[1:]  # 4 bytes off alignment: the plain store path
                K.mean_reduce(rows, out=out, backend="cython")
                assert out.tobytes() == want.tobytes()
                out64 = np.empty(m, np.float64)
                K.mean_reduce(rows, out=out64, accumulate_dtype=np.float64, backend="cython")
                assert out64.tobytes() == ref_reduce(rows, 3, np.float64).tobytes()
    finally:
        ext.set_stream_bytes(before)


@pytest.mark.parametrize("backend", HOST)
def test_read_only_inputs(backend: str) -> None:
    rows = [np.arange(70_000, dtype=np.float32) * k for k in range(1, 4)]
    rows[1].flags.writeable = False
    want = ref_reduce(rows, 3)
    assert K.mean_reduce(rows, backend=backend).tobytes() == want.tobytes()
    frozen = np.stack(rows)
    frozen.flags.writeable = False
    assert K.mean_reduce(frozen, backend=backend).tobytes() == want.tobytes()


def test_threaded_numba_kernels_match_serial_at_every_thread_count() -> None:
    from gradcoll.kernels import numba_cpu, numba_lowp

    rng = np.random.default_rng(7)
    m = 3 * numba_cpu.BLOCK + 5
    a, b = rng.standard_normal((2, m)).astype(np.float32)
    w = np.empty(m, np.uint16)
    R.encode(a, w, "bf16", False)
    big = np.float32(np.finfo(np.float32).max)
    serial_acc = a.copy()
    numba_cpu.accumulate_serial(serial_acc, b, np.float32(3), numba_cpu.DIV, np.float32(1), False, big)
    serial_w = np.empty(m, np.uint16)
    numba_lowp.encode_serial(a.view(np.uint32), serial_w, numba_lowp.FP16)
    serial_lacc = a.copy()
    numba_lowp.accumulate_serial(serial_lacc, w, R.fp16_table(), numba_lowp.BF16, np.float32(1), 0, False)
    try:
        for t in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(t)
            acc = a.copy()
            numba_cpu.accumulate_parallel(acc, b, np.float32(3), numba_cpu.DIV, np.float32(1), False, big)
            assert acc.tobytes() == serial_acc.tobytes()
            wp = np.empty(m, np.uint16)
            numba_lowp.encode_parallel(a.view(np.uint32), wp, numba_lowp.FP16)
            assert wp.tobytes() == serial_w.tobytes()
            lacc = a.copy()
            numba_lowp.accumulate_parallel(lacc, w, R.fp16_table(), numba_lowp.BF16, np.float32(1), 0, False)
            assert lacc.tobytes() == serial_lacc.tobytes()
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


WIRE_BACKENDS = [b for b in K.available_backends() if b in ("numba", "cython")]


@pytest.mark.parametrize("backend", WIRE_BACKENDS)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_wire_kernels_on_a_million_patterns(backend: str, wire: str) -> None:
    """Encode every kind of float32 (random bit patterns: NaNs, subnormals, both infinities) and widen every
    16-bit pattern, against the oracle; the vector loops and their tails both run."""
    rng = np.random.default_rng(8)
    for m in (1_000_003, 15, 16, 17):
        u = rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)
        x = u.view(np.float32)
        want = np.empty(m, np.uint16)
        R.encode(x, want, wire, False)
        got = K.encode_wire(x, wire=wire, check_finite=False, backend=backend)
        assert np.array_equal(got, want)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ref = np.empty(every.size, np.float32)
    R.decode(every, ref, wire)
    assert np.array_equal(K.decode_wire(every, wire=wire, backend=backend).view(np.uint32), ref.view(np.uint32))
    acc0 = rng.standard_normal(every.size).astype(np.float32)
    for d in (None, 2, 3):
        a1, a2 = acc0.copy(), acc0.copy()
        R.accumulate(a1, every, wire, d, False)
        K.accumulate_wire(a2, every, wire, divide_by=d, check_finite=False, backend=backend)
        assert np.array_equal(a1.view(np.uint32), a2.view(np.uint32)), d


@pytest.mark.skipif("cython" not in K.available_backends(), reason="the compiled extension is not built")
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_compiled_wire_kernels_at_every_vector_width(wire: str) -> None:
    """The AVX-512, AVX2 and scalar loops of the compiled extension (as many as this CPU has) give the
    oracle's bits, and each one's finite check catches a value that the wire cannot hold, wherever it is."""
    from gradcoll.errors import NonFiniteError
    rng = np.random.default_rng(81)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    acc0 = rng.standard_normal(every.size).astype(np.float32)
    for level in simd_widths("gradcoll.kernels._cython_kernels"):
        for m in (100_003, 15, 16, 17, 31, 32, 33, 47, 48, 65):
            u = rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)
            u[rng.integers(0, m, max(1, m // 4))] &= 0xFFFF8000  # halfway cases, both parities, and their
            u[rng.integers(0, m, max(1, m // 8))] |= 0x00000001  # neighbours, for the rounding of bf16
            x = u.view(np.float32)
            want = np.empty(m, np.uint16)
            R.encode(x, want, wire, False)
            assert np.array_equal(K.encode_wire(x, wire=wire, check_finite=False, backend="cython"), want)
            for bad in (np.float32(3.4e38), np.float32(np.nan), np.float32(-np.inf)):
                y = np.ones(m, np.float32)
                at = int(rng.integers(0, m))
                y[at] = bad
                with pytest.raises(NonFiniteError):
                    K.encode_wire(y, wire=wire, check_finite=True, backend="cython")
            K.encode_wire(np.ones(m, np.float32), wire=wire, check_finite=True, backend="cython")
        base = rng.standard_normal(100_200).astype(np.float32)
        for off in range(17):  # every start within a 64-byte line: the AVX-512 encode aligns its loads first
            for m in (5, 100, 100_003):
                x = base[off:off + m].copy() if off == 16 else base[off:off + m]
                want = np.empty(m, np.uint16)
                R.encode(x, want, wire, False)
                assert np.array_equal(K.encode_wire(x, wire=wire, check_finite=False, backend="cython"), want)
                for at in {0, min(m - 1, 7), min(m - 1, 15), m - 1}:  # in the first elements and after them
                    y = x.copy() if off == 16 else base.copy()[off:off + m]
                    y[at] = np.nan
                    want = np.empty(m, np.uint16)
                    R.encode(y, want, wire, False)
                    got = np.empty(m, np.uint16)
                    with pytest.raises(NonFiniteError) as ei:
                        K.encode_wire(y, got, wire=wire, check_finite=True, backend="cython")
                    assert ei.value.index == at and np.array_equal(got, want), (level, off, m, at)
        for d in (None, 2, 3):
            a1, a2 = acc0.copy(), acc0.copy()
            R.accumulate(a1, every, wire, d, False)
            K.accumulate_wire(a2, every, wire, divide_by=d, check_finite=False, backend="cython")
            assert np.array_equal(a1.view(np.uint32), a2.view(np.uint32)), (level, d)
        ref = np.empty(every.size, np.float32)
        R.decode(every, ref, wire)
        assert np.array_equal(K.decode_wire(every, wire=wire, backend="cython").view(np.uint32),
                              ref.view(np.uint32)), level


@pytest.mark.parametrize("backend", WIRE_BACKENDS)
def test_wire_fast_path_errors_are_explained(backend: str) -> None:
    acc = np.ones(100, np.float32)
    x = K.encode_wire(np.ones(100, np.float32), wire="bf16")
    x[41] = 0x7F80  # +Inf in bf16
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.accumulate_wire(acc, x, "bf16", backend=backend)
    assert (ei.value.contributor, ei.value.index) == (1, 41)
    assert acc[40] == 2.0  # added once, not again on the error path
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.encode_wire(np.array([1.0, 7e4, 2.0], np.float32), wire="fp16", backend=backend)
    assert ei.value.index == 1
    with pytest.raises(ValueError, match="wire must be one of"):
        K.encode_wire(np.ones(3, np.float32), wire="int8", backend=backend)


#: float32 bit patterns at the edges of the wire formats: the last values that round to a finite bf16/fp16 and
#: the first that round to Inf, both infinities, NaNs with every kind of payload (signalling, quiet, all ones),
#: both zeros, the smallest and largest subnormals and the fp16 subnormal boundaries.
EDGES = np.array([
    0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7F808000, 0x7FBFFFFF, 0x7FC00000,
    0x7FC00001, 0x7FFF0000, 0x7FFFFFFF, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x387FFFFF, 0x38800000,
    0x33000000, 0x33000001, 0x33800000, 0x00000000, 0x00000001, 0x00008000, 0x00017FFF, 0x00018000, 0x007FFFFF,
    0x3F808000, 0x3F818000, 0x3F800001,
], np.uint32)
EDGES = np.concatenate([EDGES, EDGES | np.uint32(0x80000000)])


def _edge_inputs(m: int, rng: np.random.Generator, finite_only: bool) -> np.ndarray:
    """``m`` random normal float32 values with the edge patterns planted across the blocks (or only those
    edges whose encoding is finite in both formats)."""
    x = rng.standard_normal(m).astype(np.float32)
    edges = EDGES
    if finite_only:
        mag = edges & np.uint32(0x7FFFFFFF)
        edges = edges[mag < np.uint32(0x477FF000)]
    where = rng.choice(m, size=min(m, edges.size), replace=False)
    x.view(np.uint32)[where] = edges[: where.size]
    return x


@pytest.mark.parametrize("backend", WIRE_BACKENDS)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_wire_encode_edges_both_check_modes_and_thread_counts(backend: str, wire: str) -> None:
    """The checked bf16 encode rounds without the NaN select and tests the input (one compare); the unchecked
    one keeps the select. Both give the oracle's bits, serial and threaded, on 1 and 2 threads; a checked
    call that fails names the oracle's first bad element and leaves the oracle's bits in ``dst``."""
    rng = np.random.default_rng(16)
    try:
        for t in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(t)
            for m in (EDGES.size, 70_001, 300_007):  # serial, threaded and (auto) above SMALL_ELEMS
                for finite_only in (False, True):
                    x = _edge_inputs(m, rng, finite_only)
                    want = np.empty(m, np.uint16)
                    ok = R.encode(x, want, wire, True)
                    got = K.encode_wire(x, wire=wire, check_finite=False, backend=backend)
                    assert got.tobytes() == want.tobytes(), (t, m, finite_only, "unchecked")
                    dst = np.zeros(m, np.uint16)
                    if ok:
                        K.encode_wire(x, dst, wire=wire, backend=backend)
                    else:
                        first = int(np.flatnonzero((want & R.WIRES[wire]) == R.WIRES[wire])[0])
                        with pytest.raises(gradcoll.NonFiniteError) as ei:
                            K.encode_wire(x, dst, wire=wire, backend=backend)
                        assert ei.value.index == first, (t, m)
                    assert dst.tobytes() == want.tobytes(), (t, m, finite_only, "checked")
                    assert ok == finite_only or wire == "fp16"  # fp16 also overflows on some of the finite edges
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("backend", WIRE_BACKENDS)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_wire_accumulate_edges_every_divisor_and_thread_count(backend: str, wire: str) -> None:
    """acc += decode(w) (then / d) over every 16-bit pattern, with accumulators at the float32 edges: overflow to
    Inf, -0.0 + -0.0, subnormal sums, NaN accumulators; the oracle's bits unchecked, serial and threaded, on 1
    and 2 threads; a checked call with Inf/NaN on the wire fails."""
    rng = np.random.default_rng(17)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    w = np.concatenate([every, every[rng.permutation(every.size)], every[:4_000]])  # above SMALL_ELEMS: 135,072
    w = np.concatenate([w, w])
    m = w.size
    a0 = rng.standard_normal(m).astype(np.float32)
    a0.view(np.uint32)[rng.choice(m, size=EDGES.size * 50, replace=False)] = np.tile(EDGES, 50)
    wire_bad = (w & R.WIRES[wire]) == R.WIRES[wire]
    # NaN + NaN: which payload the sum keeps is the compiler's choice (it may swap the operands), not pinned
    a0[wire_bad & np.isnan(a0)] = 1.0
    finite_w = w.copy()
    finite_w[wire_bad] = 0x8000  # -0.0: no Inf/NaN on the wire
    try:
        for t in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(t)
            for size in (m, 70_001, 1_001):
                for d in (None, 2, 3):
                    want, got = a0[:size].copy(), a0[:size].copy()
                    R.accumulate(want, w[:size], wire, d, False)
                    K.accumulate_wire(got, w[:size], wire, divide_by=d, check_finite=False, backend=backend)
                    assert got.tobytes() == want.tobytes(), (t, size, d)
                    clean = np.abs(a0[:size]) < 1e30  # finite accumulators far from overflow
                    acc0 = np.where(clean, a0[:size], np.float32(-0.0)).astype(np.float32)
                    want, got = acc0.copy(), acc0.copy()
                    assert R.accumulate(want, finite_w[:size], wire, d, True)
                    K.accumulate_wire(got, finite_w[:size], wire, divide_by=d, backend=backend)
                    assert got.tobytes() == want.tobytes(), (t, size, d, "checked")
                    with pytest.raises(gradcoll.NonFiniteError):
                        K.accumulate_wire(a0[:size].copy(), w[:size], wire, divide_by=d, backend=backend)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("backend", WIRE_BACKENDS)
def test_bf16_checked_encode_one_edge_alone(backend: str) -> None:
    """The checked bf16 encode rounds without the NaN select and runs the select again only when an input is at
    or above 0x7F7F8000: one edge at a time, in the vector part or the tail, serial and threaded, gives the
    oracle's verdict, the oracle's first bad index and the oracle's bits in ``dst`` (a NaN whose rounding as a
    number would carry into the sign bit, 0x7FFF8000 and up, included)."""
    rng = np.random.default_rng(26)
    edges = np.concatenate([EDGES, np.array([0x7FFF8000, 0xFFFF8000, 0xFFFFFFFF, 0x7FFFFFFF], np.uint32)])
    for m in (1_037, 70_001):  # serial and (backend="numba") threaded
        base = rng.standard_normal(m).astype(np.float32)
        for e in edges:
            for where in (3, m - 1):  # a vector lane, the scalar tail
                x = base.copy()
                x.view(np.uint32)[where] = e
                want = np.empty(m, np.uint16)
                ok = R.encode(x, want, "bf16", True)
                dst = np.zeros(m, np.uint16)
                if ok:
                    K.encode_wire(x, dst, wire="bf16", backend=backend)
                else:
                    with pytest.raises(gradcoll.NonFiniteError) as ei:
                        K.encode_wire(x, dst, wire="bf16", backend=backend)
                    assert ei.value.index == where, (hex(int(e)), m)
                assert ok == ((int(e) & 0x7FFFFFFF) < 0x7F7F8000), hex(int(e))
                assert dst.tobytes() == want.tobytes(), (hex(int(e)), m, where)
                for loop in (numba_lowp.bf16_checked_serial, numba_lowp.bf16_checked_parallel)[:2 * (backend == "numba")]:
                    # the Numba loops themselves (with the extension built, threaded calls run the compiled loop)
                    dst[:] = 0
                    assert (loop(x.view(np.uint32), dst) == 0) == ok, (hex(int(e)), loop)
                    if ok:
                        assert dst.tobytes() == want.tobytes(), (hex(int(e)), m, where)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_threaded_numba_wire_loops_without_the_compiled_ones(wire: str) -> None:
    """With the extension built, threaded wire calls run its loops block by block; the Numba loops that serve
    them without it give the oracle's bits too (random bit patterns: NaNs, subnormals, both infinities)."""
    rng = np.random.default_rng(27)
    m = 200_003
    u = rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)
    want = np.empty(m, np.uint16)
    R.encode(u.view(np.float32), want, wire, False)
    got = np.zeros(m, np.uint16)
    numba_lowp.encode_parallel(u, got, numba_lowp._fmt(wire))
    assert got.tobytes() == want.tobytes()
    acc0 = rng.standard_normal(m).astype(np.float32)
    w = rng.integers(0, 2**16, m, dtype=np.uint32).astype(np.uint16)
    for d in (None, 2, 3):
        a1, a2 = acc0.copy(), acc0.copy()
        R.accumulate(a1, w, wire, d, False)
        mode, f = reference.finish(d, np.dtype(np.float32))
        numba_lowp.accumulate_parallel(a2, w, R.fp16_table(), numba_lowp._fmt(wire), np.float32(f), mode, False)
        assert a1.tobytes() == a2.tobytes(), d
