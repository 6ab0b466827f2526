"""Kernels against the NumPy reference: values, bits, finite checks, errors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradcoll
from gradcoll import kernels as K
from gradcoll.kernels import reference
from gradcoll.kernels.select import choose_backend

CPU = [b for b in K.available_backends() if b in ("numpy", "numba", "cython")]
ALL = [b for b in K.available_backends() if b in ("numpy", "numba", "cython", "cudasim", "cuda")]


def oracle(rows, dtype, op="mean"):
    """Independent oracle: np.add in contributor order, then divide (no gradcoll code)."""
    acc_dt = np.float32 if np.dtype(dtype) == np.float16 else dtype
    acc = np.array(rows[0], dtype=acc_dt)
    for r in rows[1:]:
        acc = acc + np.asarray(r, dtype=acc_dt)
    if op == "mean":
        acc = acc / acc_dt(len(rows))
    return acc.astype(dtype)


def test_backends_listed():
    names = K.available_backends()
    assert "numpy" in names and "numba" in names
    if os.environ.get("GRADCOLL_REQUIRE_EXTENSION") == "1":
        assert "cython" in names, "the compiled Cython extension did not build"
    assert "cudasim" in names  # conftest turns the simulator on


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 16),
    m=st.one_of(st.sampled_from([0, 1, 2, 7, 4095, 4096, 4097]), st.integers(0, 3000)),
    dtype=st.sampled_from([np.float32, np.float64]),
    op=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_matches_reference(n, m, dtype, op, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, m)) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
    want = oracle(list(x), dtype, op)
    for be in CPU:
        got = K.mean_reduce(x, op=op, backend=be)
        assert got.dtype == dtype and got.shape == (m,)
        assert got.tobytes() == want.tobytes(), be
    # Lists take other code paths (Cython pointer table, Numba tuples).
    for be in [b for b in CPU if b != "numba"] + [None]:
        got = K.mean_reduce(list(x), op=op, backend=be)
        assert got.tobytes() == want.tobytes(), be


@pytest.mark.parametrize("n", [2, 3, 5, 9, 17])
@pytest.mark.parametrize("m", [1, 5000, 70000])
def test_numba_lists_and_threads_bit_identical(n, m):
    from gradcoll.kernels import numba_cpu

    rng = np.random.default_rng(n * m)
    x = rng.standard_normal((n, m)).astype(np.float32)
    want = oracle(list(x), np.float32)
    assert K.mean_reduce(list(x), backend="numba").tobytes() == want.tobytes()
    assert K.mean_reduce(x, backend="numba").tobytes() == want.tobytes()  # 2-D: the same passes over its rows
    # Serial and threaded kernels, and every thread count, give the same bits (n <= GROUP: one pass).
    import numba

    xs = tuple(x[: numba_cpu.GROUP])
    out_s = np.empty(m, np.float32)
    out_p = np.empty(m, np.float32)
    big = np.float32(np.finfo(np.float32).max)
    d = np.float32(len(xs))
    assert numba_cpu.sum_serial(xs, out_s, d, numba_cpu.DIV, big) == 0
    assert out_s.tobytes() == oracle(list(xs), np.float32).tobytes()
    for t in range(1, numba.config.NUMBA_NUM_THREADS + 1):
        numba.set_num_threads(t)
        out_p[:] = np.nan
        assert numba_cpu.sum_parallel(xs, out_p, d, numba_cpu.DIV, big) == 0
        assert out_p.tobytes() == out_s.tobytes()
        assert K.mean_reduce(list(x), backend="numba").tobytes() == want.tobytes()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_large_buffer_all_backends_agree():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 300_000)).astype(np.float32)
    want = oracle(list(x), np.float32)
    for be in CPU:
        assert K.mean_reduce(x, backend=be).tobytes() == want.tobytes()
    assert K.mean_reduce(list(x)).tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_planted_nonfinite_is_located(backend, bad, dtype):
    n, m = 3, (257 if backend.startswith("cuda") else 10_000)
    rng = np.random.default_rng(1)
    for who in range(n):
        for where in (0, m // 2, m - 1):
            x = rng.standard_normal((n, m)).astype(dtype)
            x[who, where] = bad
            before = x.copy()
            with pytest.raises(gradcoll.NonFiniteError) as ei:
                K.mean_reduce(x, backend=backend)
            e = ei.value
            assert (e.contributor, e.index) == (who, where), str(e)
            assert np.isnan(e.value) if np.isnan(bad) else e.value == bad
            assert np.array_equal(before, x, equal_nan=True)  # inputs untouched
            with pytest.raises(gradcoll.NonFiniteError):
                K.mean_reduce(list(x), backend=backend if backend != "numba" else "cython")


def test_nonfinite_error_is_exception_family():
    assert issubclass(gradcoll.NonFiniteError, gradcoll.GradcollError)
    with pytest.raises(FloatingPointError):
        K.check_finite(np.array([1.0, np.nan]))


@pytest.mark.parametrize("backend", ALL)
def test_negative_zero_and_subnormals_pass_through(backend):
    for dtype in (np.float32, np.float64):
        tiny = np.finfo(dtype).smallest_subnormal
        row = np.array([-0.0, tiny, -tiny, 3 * tiny, 0.0], dtype=dtype)
        got = K.mean_reduce(np.stack([row, row]), backend=backend)
        assert got.tobytes() == row.tobytes(), backend
        got1 = K.mean_reduce(row[None, :], backend=backend)
        assert got1.tobytes() == row.tobytes()


def test_overflow_is_reported_without_culprit():
    big = np.finfo(np.float32).max
    x = np.full((2, 3), big, np.float32)
    for be in CPU:
        with pytest.raises(gradcoll.NonFiniteError, match="overflow") as ei:
            K.mean_reduce(x, backend=be)
        assert ei.value.contributor is None and ei.value.index == 0
    # float64 accumulation avoids it.
    got = K.mean_reduce(x, accumulate_dtype=np.float64)
    assert got.dtype == np.float32 and np.all(got == big)


def test_check_finite_false_lets_nan_through():
    x = np.array([[1.0, np.nan], [3.0, 4.0]], np.float32)
    for be in CPU:
        got = K.mean_reduce(x, check_finite=False, backend=be)
        assert got[0] == 2.0 and np.isnan(got[1])


def test_float16_accumulates_in_float32():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 1000)).astype(np.float16)
    want = oracle(list(x), np.float16)
    for be in CPU:
        got = K.mean_reduce(x, backend=be)
        assert got.dtype == np.float16 and got.tobytes() == want.tobytes()


def test_float64_accumulation_for_float32():
    x = np.array([[1e8, 4.0], [-1e8, 4.0], [4.0, 0.0], [4.0, 0.0]], np.float32)
    for be in CPU:
        got = K.mean_reduce(x, op="sum", accumulate_dtype=np.float64, backend=be)
        assert got.dtype == np.float32 and got[0] == 8.0
        out64 = np.empty(2, np.float64)
        K.mean_reduce(x, out=out64, op="sum", accumulate_dtype=np.float64, backend=be)
        assert out64[0] == 8.0


def test_multidimensional_and_out():
    x = [np.arange(12, dtype=np.float64).reshape(3, 4) * k for k in range(1, 4)]
    out = np.empty((3, 4))
    res = K.mean_reduce(x, out=out)
    assert res is out and np.array_equal(out, np.arange(12).reshape(3, 4) * 2.0)
    stacked = np.stack(x)
    assert np.array_equal(K.mean_reduce(stacked), out)


def test_noncontiguous_inputs_are_copied():
    base = np.arange(40, dtype=np.float32).reshape(2, 20)
    rows = [base[0, ::2], base[1, ::2]]
    assert np.array_equal(K.mean_reduce(rows), (base[0, ::2] + base[1, ::2]) / 2)


@pytest.mark.parametrize(
    "call, msg",
    [
        (lambda: K.mean_reduce([np.ones(3, np.float32), np.ones(4, np.float32)]), "shape"),
        (lambda: K.mean_reduce([np.ones(3, np.float32), np.ones(3, np.float64)]), "dtype"),
        (lambda: K.mean_reduce([np.ones(3, np.int32)]), "dtype int32"),
        (lambda: K.mean_reduce([]), "at least one"),
        (lambda: K.mean_reduce(np.ones(3, np.float32)), "2-D"),
        (lambda: K.mean_reduce([np.ones(3)], out=np.empty(4)), "shape"),
        (lambda: K.mean_reduce([np.ones(4)], out=np.empty(8)[::2]), "contiguous"),
        (lambda: K.mean_reduce([np.ones(3)], op="prod"), "op"),
        (lambda: K.mean_reduce([np.ones(3)], backend="fortran"), "unknown kernel backend"),
        (lambda: K.accumulate(np.ones(3), np.ones(4)), "shape"),
        (lambda: K.accumulate(np.ones(3), np.ones(3, np.float32)), "dtype"),
        (lambda: K.accumulate(np.ones(6)[::2], np.ones(3)), "contiguous"),
        (lambda: K.scale(np.ones(3, np.int64), 2.0), "dtype"),
    ],
)
def test_bad_input_is_a_value_error(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


@pytest.mark.parametrize("backend", ALL)
def test_accumulate_scale_divide(backend):
    rng = np.random.default_rng(5)
    for m in (0, 1, 33, 20000 if not backend.startswith("cuda") else 100):
        a = rng.standard_normal(m).astype(np.float32)
        b = rng.standard_normal(m).astype(np.float32)
        acc = a.copy()
        K.accumulate(acc, b, divide_by=3, backend=backend)
        assert acc.tobytes() == ((a + b) / np.float32(3)).tobytes()
        acc = a.copy()
        K.accumulate(acc, b, scale=0.5, backend=backend)
        assert acc.tobytes() == ((a + b) * np.float32(0.5)).tobytes()
    acc = np.ones(50, np.float32)
    x = np.ones(50, np.float32)
    x[17] = -np.inf
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.accumulate(acc, x, backend=backend)
    assert (ei.value.contributor, ei.value.index) == (1, 17)


def test_accumulate_fast_path_reports_culprit():
    acc = np.ones(10, np.float32)
    acc[3] = np.nan
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.accumulate(acc, np.ones(10, np.float32))
    assert (ei.value.contributor, ei.value.index) == (0, 3)


@pytest.mark.parametrize("backend", ALL)
def test_check_finite_and_scale(backend):
    buf = np.arange(5000 if not backend.startswith("cuda") else 64, dtype=np.float64)
    K.check_finite(buf, backend=backend)
    buf[-1] = np.inf
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.check_finite(buf, backend=backend)
    assert ei.value.index == buf.size - 1
    s = np.arange(10, dtype=np.float32)
    assert np.array_equal(K.scale(s, 0.5, backend=backend), np.arange(10, dtype=np.float32) * np.float32(0.5))


def test_cudasim_device_arrays_stay_on_device():
    from numba import cuda

    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 200)).astype(np.float32)
    d = cuda.to_device(x)
    res = K.mean_reduce(d)
    assert not isinstance(res, np.ndarray)
    assert res.copy_to_host().tobytes() == oracle(list(x), np.float32).tobytes()
    res2 = K.mean_reduce([cuda.to_device(r) for r in x])
    assert res2.copy_to_host().tobytes() == oracle(list(x), np.float32).tobytes()
    x[1, 150] = np.nan
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.mean_reduce(cuda.to_device(x))
    assert (ei.value.contributor, ei.value.index) == (1, 150)


def test_env_override_and_selection(monkeypatch):
    monkeypatch.setenv("GRADCOLL_KERNELS", "numpy")
    assert choose_backend(10).NAME == "numpy"
    x = np.ones((2, 10), np.float32)
    assert np.array_equal(K.mean_reduce(x), np.ones(10, np.float32))
    monkeypatch.delenv("GRADCOLL_KERNELS")
    small = choose_backend(100).NAME
    large = choose_backend(10_000_000).NAME
    if "cython" in K.available_backends():
        assert small == "cython"
    assert large == "numba"


def test_select_backend_unavailable_chains_cause():
    with pytest.raises(gradcoll.BackendUnavailable) as ei:
        K.select_backend("cuda")  # the simulator is on, so the real GPU backend is refused
    assert ei.value.__cause__ is not None


def test_warmup_compiles_every_numba_kernel():
    # In a fresh process, so that kernels compiled by other tests do not count.
    code = """
from numba.core.registry import CPUDispatcher
from gradcoll import kernels as K
from gradcoll.kernels import numba_cpu, numba_exact, numba_lowp
assert "numba" in K.warmup()
print([f"{m.__name__}.{n}" for m in (numba_cpu, numba_lowp, numba_exact) for n, f in vars(m).items()
       if isinstance(f, CPUDispatcher) and f.targetoptions.get("inline", "never") == "never" and not f.signatures])
"""
    assert _run(code) == "[]"


def test_no_fastmath_in_finite_checking_kernels():
    from numba.core.registry import CPUDispatcher

    from gradcoll.kernels import numba_cpu, numba_exact, numba_lowp

    seen = 0
    for mod in (numba_cpu, numba_lowp, numba_exact):
        for name in dir(mod):
            fn = getattr(mod, name)
            if isinstance(fn, CPUDispatcher):
                fm = fn.targetoptions.get("fastmath", False)
                assert not fm, f"{mod.__name__}.{name} uses fastmath={fm}"
                seen += 1
    assert seen >= 10


def test_serial_and_threaded_compilations_are_cached_apart(tmp_path) -> None:
    """Numba's disk cache files an entry by function name and signature, not by options: a threaded kernel
    compiled from the same function as its serial twin would load the serial machine code (one thread) in every
    later process. Here a fresh cache holds the serial compile first; the threaded kernel must still compile
    its own (a cache miss), and load that one next time (a hit)."""
    from numba.core.registry import CPUDispatcher

    from gradcoll.kernels import numba_cpu, numba_lowp

    pairs = 0
    for mod in (numba_cpu, numba_lowp):
        for name, fn in vars(mod).items():
            twin = getattr(mod, name.replace("_serial", "_parallel"), None)
            if name.endswith("_serial") and isinstance(fn, CPUDispatcher) and isinstance(twin, CPUDispatcher):
                assert fn.targetoptions.get("parallel") is not True and twin.targetoptions.get("parallel") is True
                assert fn.__wrapped__.__qualname__ != twin.__wrapped__.__qualname__, f"{mod.__name__}.{name}"
                pairs += 1
    assert pairs >= 7
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    setup = "import numpy as np\nfrom gradcoll.kernels import numba_cpu as N\n" \
            "a, x, one, big = np.ones(64, np.float32), np.ones(64, np.float32), np.float32(1), np.float32(3e38)\n"
    _run(setup + "N.accumulate_serial(a, x, one, 0, one, False, big)", env)
    par = setup + "N.accumulate_parallel(a, x, one, 0, one, False, big)\n" \
                  "st = N.accumulate_parallel.stats\nprint(len(st.cache_hits), len(st.cache_misses))"
    assert _run(par, env) == "0 1"  # the serial entry was not taken
    assert _run(par, env) == "1 0"  # its own entry


def test_reference_locates_first_element_then_contributor():
    rows = [np.array([0.0, 1.0, np.nan]), np.array([0.0, np.inf, 0.0])]
    assert reference.locate_nonfinite(rows) == (1, 1, np.inf)


def _run(code: str, env: dict[str, str] | None = None) -> str:
    full_env = {**os.environ, **(env or {})}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=full_env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_is_lazy():
    out = _run("import sys, gradcoll; print('numba' in sys.modules, 'numba.cuda' in sys.modules)")
    assert out == "False False"


def test_works_without_extension_and_numba_cuda():
    code = """
import sys
class Block:
    def find_spec(self, name, path, target=None):
        if name in ('gradcoll.kernels._cython_kernels', 'numba.cuda') or name.startswith('numba.cuda.'):
            raise ImportError('blocked for the test: ' + name)
sys.meta_path.insert(0, Block())
import numpy as np, gradcoll
from gradcoll import kernels as K
names = K.available_backends()
assert 'cython' not in names and 'cudasim' not in names and 'cuda' not in names, names
r = K.mean_reduce([np.ones(5, np.float32), np.full(5, 3, np.float32)])
assert r.tolist() == [2.0] * 5
import os
from gradcoll.kernels.select import fast_path, resolve
os.environ.pop("GRADCOLL_KERNELS", None)
assert fast_path("reduce") is None and resolve("reduce", 5).NAME == "numba"
os.environ["GRADCOLL_KERNELS"] = "numpy"  # read with os.environ.get without the extension
assert resolve("reduce", 5).NAME == "numpy"
print(names)
"""
    assert "numba" in _run(code, {"NUMBA_ENABLE_CUDASIM": "1"})


@pytest.mark.gpu
def test_real_gpu_matches_reference():
    """On a real GPU (GRADCOLL_TEST_REAL_GPU=1): bits and NaN location match the reference."""
    from numba import cuda

    rng = np.random.default_rng(21)
    for n, m in ((2, 1), (4, 100_003), (8, 1 << 20)):
        x = rng.standard_normal((n, m)).astype(np.float32)
        got = K.mean_reduce(cuda.to_device(x)).copy_to_host()
        assert got.tobytes() == oracle(list(x), np.float32).tobytes()
        x[n - 1, m // 2] = np.nan
        with pytest.raises(gradcoll.NonFiniteError) as ei:
            K.mean_reduce(cuda.to_device(x))
        assert (ei.value.contributor, ei.value.index) == (n - 1, m // 2)


@pytest.mark.parametrize("backend", CPU + [None])
def test_float16_check_finite_and_scale(backend):
    for i in range(200):  # garbage after the buffer must never be read as float32
        junk = [np.full(37 + i % 50, np.nan, np.float32) for _ in range(5)]
        del junk
        K.check_finite(np.arange(50, dtype=np.float16) * 3, backend=backend)
    h = np.ones(70_000, dtype=np.float16)
    h[-1] = np.inf
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.check_finite(h, backend=backend)
    assert ei.value.index == 69_999
    s = np.ones(70_000, np.float16)
    assert np.all(K.scale(s, 0.5, backend=backend) == np.float16(0.5))
