"""Low-precision wire: kernels against the NumPy oracle, allreduce error bounds, overflow caught."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gradcoll import kernels as K
from gradcoll.algorithms import SCHEDULES
from gradcoll.algorithms.low_precision import wire_allreduce
from gradcoll.errors import NonFiniteError, UsageError
from gradcoll.group.process_group import ProcessGroup
from gradcoll.kernels import lowp_reference as R
from gradcoll.testing import gather_ranks
from gradcoll.transport.inproc import create_world

ALGOS = tuple(name for name, s in SCHEDULES.items() if s.rows is not None)  # every schedule with a rows form
U = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # unit roundoff of the wire formats
U32 = 2.0**-24
WIRE_BACKENDS = ["numpy", "numba"] + [b for b in K.available_backends() if b in ("cython", "cudasim")]


def run(n: int, fn: Callable[[int, Any], Any]) -> tuple[list[Any], list[BaseException | None]]:
    ts = create_world(n, timeout=10.0)
    return gather_ranks(lambda r: fn(r, ts[r]), n)


def edge_bits() -> np.ndarray:
    edges = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF, 0x7F7F8000,
             0x7F7F7FFF, 0x477FF000, 0x477FEFFF, 0x477FF001, 0x47800000, 0x33000000, 0x33000001, 0x38800000,
             0x387FFFFF, 0x38000000, 1, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x33800000, 0x337FFFFF]
    rng = np.random.default_rng(5)
    return np.concatenate([np.array(edges, np.uint32), rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)])


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", WIRE_BACKENDS)
def test_encode_decode_accumulate_match_oracle(wire: str, backend: str) -> None:
    x = edge_bits().view(np.float32)
    if backend == "cudasim":
        x = x[:64]  # the simulator runs a Python thread per CUDA thread
    want = np.empty(x.size, np.uint16)
    R.encode(x, want, wire, False)
    got = K.encode_wire(x, wire=wire, check_finite=False, backend=backend)
    assert np.array_equal(got, want)
    dec = K.decode_wire(want, wire=wire, backend=backend)
    ref = np.empty(x.size, np.float32)
    R.decode(want, ref, wire)
    assert np.array_equal(dec.view(np.uint32), ref.view(np.uint32))
    acc = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    a1, a2 = acc.copy(), acc.copy()
    R.accumulate(a1, want, wire, 3, False)
    K.accumulate_wire(a2, want, wire, divide_by=3, check_finite=False, backend=backend)
    assert np.array_equal(a1.view(np.uint32), a2.view(np.uint32))


@pytest.mark.skipif("cudasim" not in WIRE_BACKENDS, reason="needs numba-cuda (pip install -e .[cuda]); runs under the simulator")
def test_device_decode_table_is_copied_once_per_context() -> None:
    from gradcoll.kernels import cuda as C

    for wire in ("bf16", "fp16"):
        first = C._wire_table(wire)
        K.decode_wire(np.arange(8, dtype=np.uint16), wire=wire, backend="cudasim")
        assert C._wire_table(wire) is first
    assert C._wire_table("bf16") is not C._wire_table("fp16")


def test_bf16_rounds_to_nearest_even_and_keeps_nan() -> None:
    x = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7FC00001, 0xFF800001], np.uint32).view(np.float32)
    w = K.encode_wire(x, wire="bf16", check_finite=False)
    assert list(w[:3]) == [0x3F80, 0x3F82, 0x3F81]  # tie to even (down), tie to even (up), above the tie
    assert all(np.isnan(K.decode_wire(w[3:], wire="bf16")))
    assert w[4] >> 15 == 1  # sign kept


def test_fp16_matches_ieee_conversion() -> None:
    x = edge_bits().view(np.float32)
    x = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(K.encode_wire(x, wire="fp16", check_finite=False), want)


@pytest.mark.parametrize("backend", WIRE_BACKENDS)
def test_fp16_overflow_is_caught_at_encode(backend: str) -> None:
    x = np.array([1.0, 65519.0, 65520.0, 2.0], np.float32)  # 65520 rounds to Inf in fp16
    with pytest.raises(NonFiniteError) as info:
        K.encode_wire(x, wire="fp16", backend=backend)
    assert info.value.index == 2 and "overflows" in str(info.value)
    with pytest.raises(NonFiniteError):
        K.encode_wire(np.array([np.nan], np.float32), wire="bf16", backend=backend)
    acc = np.array([3e38], np.float32)
    with pytest.raises(NonFiniteError):
        K.accumulate_wire(acc, K.encode_wire(np.array([3e38], np.float32), wire="bf16"), "bf16", backend=backend)


def bound(algo: str, wire: str, n: int, data: list[np.ndarray], mean: np.ndarray) -> float:
    """The documented bound (docs/algorithms/wire.md) on max |result - float64 mean|."""
    u = U[wire]
    mean_abs = np.abs(np.stack(data)).astype(np.float64).mean(0)
    return float(np.max(u * np.abs(mean) + (u + n * U32) * mean_abs * (1 + u)))  # the same for every algorithm


def naive_ring_error(data: list[np.ndarray], wire: str) -> float:
    """Mean error of a ring that accumulates in the wire format: every partial sum is rounded at every hop."""
    acc = np.zeros(data[0].size, np.float32)
    w = np.empty(data[0].size, np.uint16)
    for x in data:
        np.add(acc, x, out=acc)
        R.encode(acc, w, wire, False)
        R.decode(w, acc, wire)
    ref = np.stack(data).astype(np.float64).sum(0)
    return float(np.mean(np.abs(acc / len(data) - ref / len(data))))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_error_bounded_independent_of_world_size(algo: str, wire: str) -> None:
    rng = np.random.default_rng(11)
    errs, naive = [], []
    for n in (2, 4, 8):
        data = [(1.0 + 0.25 * rng.standard_normal(4099)).astype(np.float32) for _ in range(n)]
        bufs = [d.copy() for d in data]
        _, err = run(n, lambda r, t: wire_allreduce(t, bufs[r], wire=wire, algorithm=algo, seq=1))
        assert err == [None] * n
        assert all(b.tobytes() == bufs[0].tobytes() for b in bufs)  # same bits on every rank
        mean = np.stack(data).astype(np.float64).mean(0)
        assert float(np.max(np.abs(bufs[0] - mean))) <= bound(algo, wire, n, data, mean)
        errs.append(float(np.mean(np.abs(bufs[0] - mean))))
        naive.append(naive_ring_error(data, wire))
    print(algo, wire, 'mean |err| n=2,4,8:', errs, 'naive:', naive)
    assert max(errs) <= 1.25 * errs[0]  # flat in n, for every algorithm
    assert naive[-1] > 1.3 * naive[0] and naive[-1] > errs[-1]  # while a wire-accumulating ring's grows


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 1000])
def test_all_ranks_same_bits(algo: str, n: int, count: int) -> None:
    rng = np.random.default_rng(n * 1000 + count)
    data = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    bufs = [d.copy() for d in data]
    _, err = run(n, lambda r, t: wire_allreduce(t, bufs[r], wire="bf16", algorithm=algo, op="sum", seq=2))
    assert err == [None] * n
    assert all(b.tobytes() == bufs[0].tobytes() for b in bufs)
    if count and n > 1:
        want = np.stack(data).astype(np.float64).sum(0)
        assert np.allclose(bufs[0], want, atol=8 * U["bf16"] * n * 4, rtol=0.05)


@pytest.mark.parametrize("algo", ALGOS)
def test_fp16_overflow_halts_every_rank(algo: str) -> None:
    n = 3
    bufs = [np.ones(10, np.float32) for _ in range(n)]
    bufs[1][4] = 70000.0  # finite in float32, Inf in fp16
    _, err = run(n, lambda r, t: wire_allreduce(t, bufs[r], wire="fp16", algorithm=algo, seq=4))
    assert all(isinstance(e, NonFiniteError) for e in err), err
    assert all("rank 1" in str(e) for e in err)
    # A sum that overflows fp16 although every input fits:
    bufs = [np.full(10, 40000.0, np.float32) for _ in range(2)]
    _, err = run(2, lambda r, t: wire_allreduce(t, bufs[r], wire="fp16", algorithm=algo, op="sum", seq=5))
    assert all(isinstance(e, NonFiniteError) for e in err), err


def test_ring_overflow_is_marked_at_its_chunk() -> None:
    n, count = 3, 30
    bufs = [np.ones(count, np.float32) for _ in range(n)]
    for b in bufs:
        b[25] = 40000.0  # the sum overflows fp16 in the last chunk (elements 20..29) only
    _, err = run(n, lambda r, t: wire_allreduce(t, bufs[r], wire="fp16", op="sum", seq=6))
    for e in err:
        assert isinstance(e, NonFiniteError) and e.contributor is None and e.index == 20, err


@pytest.mark.parametrize("algo", ALGOS)
def test_zero_length_against_one_element_is_a_mismatch_on_every_rank(algo: str) -> None:
    from gradcoll.errors import CollectiveMismatch

    _, err = run(3, lambda r, t: wire_allreduce(t, np.ones(int(r == 1), np.float32), wire="bf16", algorithm=algo,
                                                seq=1, timeout=2.0))
    assert all(isinstance(e, CollectiveMismatch) and "count=0" in str(e) and "count=1" in str(e) for e in err), err


def test_group_wire_and_half_inputs() -> None:
    n = 4
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(300).astype(np.float32) for _ in range(n)]

    def body(r: int, t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        g = ProcessGroup(t)
        a = g.allreduce(data[r].copy(), wire_dtype="bf16")
        h = g.allreduce(data[r].astype(np.float16))  # float16 travels as itself, sums in float32
        bits = K.encode_wire(data[r], wire="bf16")
        b = g.allreduce(bits, wire_dtype="bf16", algorithm="star")  # bf16 held as uint16 bit patterns
        return a, h, b

    out, err = run(n, body)
    assert err == [None] * n
    mean = np.stack(data).astype(np.float64).mean(0)
    a, h, b = out[0]
    assert np.abs(a - mean).max() < 0.05 and np.abs(h.astype(np.float64) - mean).max() < 0.01
    assert np.abs(K.decode_wire(b, wire="bf16") - mean).max() < 0.05
    assert all(o[0].tobytes() == a.tobytes() and o[1].tobytes() == h.tobytes() for o in out)


def test_usage_errors() -> None:
    t = create_world(1)[0]
    with pytest.raises(UsageError):
        wire_allreduce(t, np.ones(3, np.float64), wire="bf16")
    with pytest.raises(UsageError):
        wire_allreduce(t, np.ones(3, np.float32), wire="int8")
    with pytest.raises(UsageError):
        wire_allreduce(t, np.ones(3, np.float32), wire="bf16", op="prod")
    with pytest.raises(UsageError):
        wire_allreduce(t, np.ones(3, np.float32), wire="bf16", algorithm="nope")
    with pytest.raises(UsageError):
        K.encode_wire(np.ones(3), wire="bf16")


@pytest.mark.parametrize("algo", ALGOS)
def test_absent_peer_is_a_timeout_naming_it(algo: str) -> None:
    from gradcoll.errors import CollectiveTimeout

    ts = create_world(3, timeout=10.0)
    data = [np.full(300, r + 1.0, np.float32) for r in range(3)]

    def body(r: int) -> None:
        if r != 2:  # rank 2 never calls
            wire_allreduce(ts[r], data[r], wire="bf16", algorithm=algo, seq=4, timeout=1.0)

    _, err = gather_ranks(body, 3)
    for e in err[:2]:
        assert isinstance(e, CollectiveTimeout), err
        assert 2 in e.missing and "bf16 wire" in str(e) and "step" in str(e) and "seq 4" in str(e), e
    assert err[2] is None
