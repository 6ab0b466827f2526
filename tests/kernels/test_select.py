"""The one selection policy (gradcoll.kernels.select): every kind, request and size class picks what the table
documents; GRADCOLL_KERNELS overrides; an injected backend object gets the calls."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import gradcoll
from gradcoll import kernels as K
from gradcoll.kernels import select
from gradcoll.kernels.select import candidates, fast_path, implementation, resolve

SMALL, LARGE = 100, select.SMALL_ELEMS + 1
REQUESTS = [None, "cython", "numba", "numpy", "cuda", "cudasim"]
AVAILABLE = K.available_backends()


def _documented() -> dict[tuple[str, str | None, bool, bool], tuple[str, ...]]:
    """The table of the select module's docstring: (kind, request, large, half) -> backends to try."""
    doc = select.__doc__ or ""
    lines = [ln for ln in doc.splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    header = [c.strip(" `") for c in lines[0].strip("|").split("|")]
    assert header[0] == "kind" and len(header) == 7, header
    out: dict[tuple[str, str | None, bool, bool], tuple[str, ...]] = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        kinds, half = cells[0], "float16" in cells[0] or "fp16 wire" in cells[0]
        if "fp16 wire" in kinds:  # lowp on the fp16 wire format: resolve(..., half=True)
            kind_names: tuple[str, ...] = ("lowp",)
        elif half:
            kind_names = ("accumulate", "finite", "scale")
        else:
            kind_names = tuple(k.split("(")[0].strip() for k in kinds.split(","))
        for kind in kind_names:
            for (request, large), cell in zip([(None, False), (None, True), ("cython", None), ("numba", None),
                                               ("numpy", None), ("cuda", None)], cells[1:], strict=True):
                for req in (["cuda", "cudasim"] if request == "cuda" else [request]):
                    names = tuple(n.strip() for n in cell.split(","))
                    if names == ("that one",):
                        names = (str(req),)
                    for lg in ([large] if large is not None else [False, True]):
                        out[(kind, req, lg, half)] = names
    return out


DOCUMENTED = _documented()


def test_the_docstring_table_covers_every_kind_and_request() -> None:
    for kind in select.KINDS:
        for req in REQUESTS:
            for large in (False, True):
                assert (kind, req, large, False) in DOCUMENTED, (kind, req, large)
    assert ("finite", "numba", True, True) in DOCUMENTED
    for req in REQUESTS:
        for large in (False, True):
            assert ("lowp", req, large, True) in DOCUMENTED, (req, large)


def test_every_kind_request_and_size_picks_the_documented_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADCOLL_KERNELS", raising=False)
    for kind in select.KINDS:
        for request in REQUESTS:
            for size in (SMALL, LARGE):
                for half in (False, True):
                    large = size > select.SMALL_ELEMS
                    want = DOCUMENTED.get((kind, request, large, half)) or DOCUMENTED[(kind, request, large, False)]
                    where = (kind, request, size, half)
                    assert candidates(kind, request, size, half=half) == want, where
                    loadable = [n for n in want if _loads(n, kind)]
                    if not loadable:
                        with pytest.raises(gradcoll.BackendUnavailable):
                            resolve(kind, size, backend=request, half=half)
                    else:
                        assert resolve(kind, size, backend=request, half=half) is implementation(loadable[0], kind), where


def _loads(name: str, kind: str) -> bool:
    try:
        implementation(name, kind)
    except gradcoll.BackendUnavailable:
        return False
    return True


def test_what_this_machine_runs() -> None:
    """Spelled out for the machine the suite runs on (the extension built, Numba, the CUDA simulator)."""
    from gradcoll.kernels import cuda, cython_backend, cython_lowp, exact_reference, lowp_reference, numba_cpu, numba_exact, numba_lowp, numpy_backend

    if "cython" not in AVAILABLE:
        pytest.skip("the compiled extension is not built (pip install -e . with a C compiler)")
    assert resolve("reduce", SMALL) is cython_backend and resolve("reduce", LARGE) is numba_cpu
    assert resolve("finite", SMALL) is cython_backend and resolve("scale", LARGE) is numba_cpu
    assert resolve("accumulate", LARGE, half=True) is numpy_backend
    assert resolve("lowp", SMALL) is cython_lowp and resolve("lowp", LARGE) is numba_lowp  # bf16: threads when large
    assert resolve("lowp", SMALL, half=True) is cython_lowp and resolve("lowp", LARGE, half=True) is numba_lowp  # fp16 too
    assert resolve("lowp", LARGE, backend="cython") is cython_lowp and resolve("lowp", LARGE, backend="numba") is numba_lowp
    assert resolve("lowp", SMALL, backend="numpy") is lowp_reference
    assert resolve("exact", SMALL) is numba_exact and resolve("exact", SMALL, backend="cython") is numba_exact
    assert resolve("exact", SMALL, backend="numpy") is exact_reference
    assert resolve("reduce", device=True) is cuda and resolve("lowp", device=True, backend="cudasim") is cuda


def test_device_arrays_need_a_device_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert candidates("reduce", None, device=True) == ("cuda", "cudasim")
    with pytest.raises(ValueError, match="device arrays need 'cuda' or 'cudasim'"):
        resolve("reduce", device=True, backend="numba")
    monkeypatch.setenv("GRADCOLL_KERNELS", "numpy")  # a host override does not move device arrays
    assert resolve("reduce", device=True) is implementation("cudasim")


def test_unknown_names_are_usage_errors() -> None:
    with pytest.raises(ValueError, match="unknown kernel backend 'fortran'"):
        resolve("lowp", 10, backend="fortran")
    with pytest.raises(ValueError, match="unknown kernel kind"):
        resolve("fft", 10)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.encode_wire(np.ones(3, np.float32), backend="fortran")


@pytest.mark.parametrize("name", ["numpy", "numba", "cython"])
def test_gradcoll_kernels_names_the_backend_of_every_kind(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if name not in AVAILABLE:
        pytest.skip(f"{name} does not load here")
    monkeypatch.setenv("GRADCOLL_KERNELS", f" {name.upper()} ")  # read stripped, in any case
    assert select.kernels_env() == name
    for kind in ("reduce", "accumulate", "finite", "scale"):
        assert resolve(kind, SMALL) is implementation(name, kind) and resolve(kind, LARGE) is implementation(name)
    lowp = "numba" if name == "cython" and not _loads("cython", "lowp") else name
    assert resolve("lowp", SMALL) is implementation(lowp, "lowp")
    assert resolve("exact", SMALL) is implementation("numpy" if name == "numpy" else "numba", "exact")
    # And the facade follows it: the compiled fast path only where the table picks cython.
    assert (fast_path("reduce") is not None) == (name == "cython")
    x = np.arange(20, dtype=np.float32).reshape(2, 10)
    assert K.mean_reduce(list(x)).tolist() == ((x[0] + x[1]) / 2).tolist()
    monkeypatch.delenv("GRADCOLL_KERNELS")
    assert select.kernels_env() is None


def test_fast_path_follows_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADCOLL_KERNELS", raising=False)
    if "cython" not in AVAILABLE:
        assert fast_path("reduce") is None and fast_path("accumulate", "cython") is None
        return
    auto, named = fast_path("reduce"), fast_path("reduce", "cython")
    assert auto is not None and auto[1] == select.REDUCE_SMALL_ELEMS  # larger buffers go to numba
    assert named is not None and named[1] > 1 << 40  # cython named: every size
    assert fast_path("accumulate") is not None
    for other in ("numba", "numpy", "cudasim"):
        assert fast_path("reduce", other) is None
    assert fast_path("finite") is None
    lowp = fast_path("lowp")  # encode, accumulate, bf16 limit, fp16 limit (then threads, F16C loops for fp16)
    assert lowp is not None and len(lowp) == 4 and lowp[2] == lowp[3] == select.SMALL_ELEMS
    named = fast_path("lowp", "cython")
    assert named is not None and named[2] > 1 << 40 and named[3] > 1 << 40
    assert fast_path("lowp", "numba") is None
    assert fast_path("reduce", object()) is None  # an injected backend gets every call


def test_the_compiled_mean_reduce_gives_the_python_facades_results_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the extension is built, ``mean_reduce`` is its compiled twin: same bits, same errors, and every call
    it does not take itself (a named backend, GRADCOLL_KERNELS, accumulate_dtype) goes to the Python facade."""
    if "cython" not in AVAILABLE:
        pytest.skip("the compiled extension is not built (a C compiler at install time builds it)")
    twin, python, rest = K.mean_reduce, K.mean_reduce.__wrapped__, K._reduce_rest  # type: ignore[attr-defined]
    assert twin is not python and "cython" in type(twin).__name__
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    seen: list[str] = []
    ext = select.extension()
    ext.bind_mean_reduce(select._FAST_CACHE["reduce"], lambda *a, **k: seen.append("python") or python(*a, **k),
                         lambda *a: seen.append("rest") or rest(*a))
    try:
        monkeypatch.delenv("GRADCOLL_KERNELS", raising=False)
        assert fast_path("reduce") is not None  # the policy's entry for the default request, now in its cache
        out = np.empty(1000, np.float32)
        for args, kw, path in [((xs,), {}, []), ((xs,), {"op": "sum"}, []), ((tuple(xs),), {"out": out}, []),
                               (([x.astype(np.float64) for x in xs],), {"check_finite": False}, []),
                               ((np.stack(xs),), {}, ["rest"]), ((xs,), {"accumulate_dtype": np.float64}, ["python"]),
                               ((xs,), {"backend": "numpy"}, ["python"]), ((xs,), {"op": 1}, ["python"])]:
            seen.clear()
            if kw.get("op") == 1:
                with pytest.raises(gradcoll.UsageError, match="op must be"):
                    twin(*args, **kw)
            else:
                got = twin(*args, **kw)
                assert got.tobytes() == python(*args, **kw).tobytes() and (got is out) == ("out" in kw), kw
            assert seen == path, kw
        bad = [x.copy() for x in xs]
        bad[2][17] = np.inf
        seen.clear()
        with pytest.raises(gradcoll.NonFiniteError) as a:
            twin(bad)
        with pytest.raises(gradcoll.NonFiniteError) as b:
            python(bad)
        assert str(a.value) == str(b.value) and "17" in str(a.value) and seen == ["rest"]
        monkeypatch.setenv("GRADCOLL_KERNELS", "numpy")  # the override is the Python facade's to apply
        seen.clear()
        assert twin(xs).tobytes() == python(xs, backend="numpy").tobytes() and seen == ["python"]
    finally:
        ext.bind_mean_reduce(select._FAST_CACHE["reduce"], python, rest)


class Recorder:
    """A backend object: computes with the NumPy reference and records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        from gradcoll.kernels import exact_reference, lowp_reference, numpy_backend

        self._np, self._lp, self._ex = numpy_backend, lowp_reference, exact_reference

    def reduce_rows(self, rows: Any, out: np.ndarray, acc_dtype: Any, divisor: float, check: bool) -> bool:
        self.calls.append("reduce_rows")
        return bool(self._np.reduce_rows(rows, out, acc_dtype, divisor, check))

    def accumulate(self, acc: np.ndarray, x: np.ndarray, scale: float | None, divisor: float | None,
                   check: bool) -> bool:
        self.calls.append("accumulate")
        return bool(self._np.accumulate(acc, x, scale, divisor, check))

    def is_all_finite(self, buf: np.ndarray) -> bool:
        self.calls.append("is_all_finite")
        return bool(self._np.is_all_finite(buf))

    def scale(self, buf: np.ndarray, factor: float) -> None:
        self.calls.append("scale")
        self._np.scale(buf, factor)

    def lowp_encode(self, src: np.ndarray, dst: np.ndarray, wire: str, check: bool) -> bool:
        self.calls.append("lowp_encode")
        return bool(self._lp.lowp_encode(src, dst, wire, check))

    def lowp_decode(self, src: np.ndarray, dst: np.ndarray, wire: str) -> None:
        self.calls.append("lowp_decode")
        self._lp.lowp_decode(src, dst, wire)

    def lowp_accumulate(self, acc: np.ndarray, x: np.ndarray, wire: str, divisor: float | None, check: bool) -> bool:
        self.calls.append("lowp_accumulate")
        return bool(self._lp.lowp_accumulate(acc, x, wire, divisor, check))

    def exact_reduce(self, own: np.ndarray, rows: np.ndarray, out: np.ndarray, divisor: float) -> int:
        self.calls.append("exact_reduce")
        return int(self._ex.exact_reduce(own, rows, out, divisor))


@pytest.mark.parametrize("m", [SMALL, LARGE])
def test_an_injected_backend_gets_every_call(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADCOLL_KERNELS", "numba")  # an object wins over the override, at every size
    be = Recorder()
    rng = np.random.default_rng(m)
    x = rng.standard_normal((3, m)).astype(np.float32)
    out = np.empty(m, np.float32)
    assert K.mean_reduce(list(x), out=out, backend=be) is out
    assert out.tobytes() == ((x[0] + x[1] + x[2]) / np.float32(3)).tobytes()
    acc = x[0].copy()
    K.accumulate(acc, x[1], divide_by=2, backend=be)
    assert acc.tobytes() == ((x[0] + x[1]) / np.float32(2)).tobytes()
    K.check_finite(acc, backend=be)
    K.scale(acc, 2.0, backend=be)
    K.accumulate(np.ones(4, np.float16), np.ones(4, np.float16), backend=be)  # float16 too
    w = K.encode_wire(x[0], wire="bf16", backend=be)
    K.decode_wire(w, wire="bf16", backend=be)
    K.accumulate_wire(acc, w, "bf16", backend=be)
    assert K.exact_reduce(x[0], x[1:], out, 3.0, backend=be) == -1
    assert be.calls == ["reduce_rows", "accumulate", "is_all_finite", "scale", "accumulate", "lowp_encode",
                        "lowp_decode", "lowp_accumulate", "exact_reduce"]
    # The facade still explains a non-finite result the object reports.
    x[2, 7] = np.inf
    with pytest.raises(gradcoll.NonFiniteError) as ei:
        K.mean_reduce(x, backend=be)
    assert (ei.value.contributor, ei.value.index) == (2, 7)


def test_an_injected_backend_without_a_kind_is_named() -> None:
    class OnlyFinite:
        def is_all_finite(self, buf: np.ndarray) -> bool:
            return True

    K.check_finite(np.ones(3), backend=OnlyFinite())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"has no reduce_rows\(\) for the reduce kernels"):
        K.mean_reduce([np.ones(3)], backend=OnlyFinite())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"has no lowp_encode\(\)"):
        K.encode_wire(np.ones(3, np.float32), backend=OnlyFinite())  # type: ignore[arg-type]


def test_the_facade_reads_no_private_environ() -> None:
    import inspect

    from gradcoll.kernels import _compiled, _lowp, _validate

    for mod in (select, K, _compiled, _lowp, _validate):
        assert not re.search(r"environ\._data", inspect.getsource(mod)), mod.__name__


@pytest.mark.skipif(not {"cython", "numba"} <= set(AVAILABLE), reason="needs the compiled extension and Numba: "
                    "pip install -e . with numba installed")
def test_large_plain_calls_go_from_the_fast_entry_to_the_threaded_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above SMALL_ELEMS a plain automatic call is validated in C and handed to the threaded Numba kernels (the
    facade's Python checks are skipped); the results are the reference's bits, a NaN is located as before, and
    anything the entry does not take (read-only or 2-D inputs, more than GROUP inputs) goes the general way."""
    from gradcoll.kernels import lowp_reference, numba_cpu, numba_lowp, reference
    from gradcoll.kernels._compiled import extension

    monkeypatch.delenv("GRADCOLL_KERNELS", raising=False)
    calls: list[str] = []

    def spy(name: str, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            calls.append(name)
            return fn(*args)
        return run

    resolve("reduce", LARGE)  # the first resolution to Numba registers the kernels
    ext = extension()
    ext.set_threaded(spy("reduce", numba_cpu.reduce_plain), numba_cpu.GROUP, spy("acc", numba_cpu.accumulate),
                     spy("enc", numba_lowp.lowp_encode), spy("accw", numba_lowp.lowp_accumulate))
    saved = _drop_entries(ext, monkeypatch)  # every large reduce through the Python callable here
    try:
        rng = np.random.default_rng(3)
        m = LARGE + 5
        rows = [rng.standard_normal(m).astype(np.float32) for _ in range(9)]
        for n in (2, 3, 8, 9):
            want = np.empty(m, np.float32)
            reference.reduce_rows(rows[:n], want, np.dtype(np.float32), n, True)
            got = K.mean_reduce(rows[:n])
            assert got.tobytes() == want.tobytes(), n
        assert calls == ["reduce"] * 3  # 9 inputs: more than one pass, the general way
        ro = [r.copy() for r in rows[:2]]
        ro[1].flags.writeable = False
        two = K.mean_reduce(rows[:2]).tobytes()
        assert K.mean_reduce(ro).tobytes() == two
        assert K.mean_reduce(np.stack(rows[:2])).tobytes() == two
        assert calls == ["reduce"] * 4
        bad = [r.copy() for r in rows[:4]]
        bad[2][m - 7] = np.nan
        with pytest.raises(gradcoll.NonFiniteError) as ei:
            K.mean_reduce(bad)
        assert (ei.value.contributor, ei.value.index) == (2, m - 7)
        acc, want = rows[0].copy(), rows[0].copy()
        reference.accumulate(want, rows[1], None, 2, True)
        K.accumulate(acc, rows[1], divide_by=2)
        assert acc.tobytes() == want.tobytes()
        w = K.encode_wire(rows[1], wire="bf16")
        ref = np.empty(m, np.uint16)
        lowp_reference.lowp_encode(rows[1], ref, "bf16", True)
        assert w.tobytes() == ref.tobytes()
        acc2 = rows[0].copy()
        K.accumulate_wire(acc2, w, "bf16", divide_by=2)
        assert calls[-3:] == ["acc", "enc", "accw"]
        w[m - 2] = 0x7FC0  # a NaN on the wire
        with pytest.raises(gradcoll.NonFiniteError) as ei:
            K.accumulate_wire(rows[0].copy(), w, "bf16")
        assert (ei.value.contributor, ei.value.index) == (1, m - 2)
    finally:
        select._threaded.cache_clear()
        ext.set_threaded(None, 0, None, None, None)
        select._threaded(ext)
        _restore_entries(ext, saved)


def _drop_entries(ext: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[bool, int]], list[str]]:
    """Remove the threaded kernels' C entries and stop new ones being registered (for this test); what was
    there."""
    from gradcoll.kernels import numba_cpu, numba_lowp

    saved = ext.threaded_reduce_entries(), ext.threaded_entries()
    for double, n in saved[0]:
        ext.set_threaded_reduce(double, n, 0, numba_cpu.PARALLEL_ELEMS)
    for name in saved[1]:
        ext.set_threaded_entry(name, 0, numba_cpu.PARALLEL_ELEMS)
    monkeypatch.setattr(numba_cpu, "_register", None)
    monkeypatch.setattr(numba_cpu, "_register_entry", None)
    monkeypatch.setattr(numba_lowp, "_register_entry", None)
    return saved


def _restore_entries(ext: Any, saved: tuple[list[tuple[bool, int]], list[str]]) -> None:
    from gradcoll.kernels import numba_cpu, numba_lowp

    for double, n in saved[0]:
        dt = np.dtype(np.float64 if double else np.float32)
        ext.set_threaded_reduce(double, n, numba_cpu.reduce_entry(dt, n), numba_cpu.PARALLEL_ELEMS)
    for name in saved[1]:
        address = (numba_cpu.accumulate_entry(np.dtype(name.replace("accumulate_f", "float")))
                   if name in ("accumulate_f32", "accumulate_f64") else numba_lowp.entry(name))
        ext.set_threaded_entry(name, address, numba_cpu.PARALLEL_ELEMS)


@pytest.mark.skipif(not {"cython", "numba"} <= set(AVAILABLE), reason="needs the compiled extension and Numba: "
                    "pip install -e . with numba installed")
def test_large_reduces_run_the_threaded_kernel_from_c_after_the_first() -> None:
    """The first threaded reduce of a dtype and count of inputs registers that kernel's C entry
    (``numba_cpu.reduce_entry``) with the extension, whose fast entry then calls it with no Python in between:
    the reference's bits for 1-8 inputs, float32 and float64, mean (powers of two multiply, other counts
    divide) and sum; a NaN located as before; and the registered entry is really what runs."""
    from gradcoll.kernels import numba_cpu, reference
    from gradcoll.kernels._compiled import extension

    resolve("reduce", LARGE)
    ext = extension()
    rng = np.random.default_rng(5)
    m = 100_003  # threads from 98,305 outputs for 1 input (2 * m > 3 * PARALLEL_ELEMS)
    for dt in (np.float32, np.float64):
        rows = [rng.standard_normal(m).astype(dt) * dt(1e3) for _ in range(8)]
        rows[0][:3] = [-0.0, np.finfo(dt).tiny / 4, np.finfo(dt).max / 2]  # a negative zero, a subnormal, a large
        for n in range(1, 9):
            for op, divisor in (("mean", n), ("sum", 1)):
                want = np.empty(m, dt)
                assert reference.reduce_rows(rows[:n], want, np.dtype(dt), divisor, True)
                for _ in range(2):  # the first call may register the entry, the second runs it
                    got = K.mean_reduce(rows[:n], op=op)
                    assert got.tobytes() == want.tobytes(), (dt, n, op)
                out = np.full(m, 7, dt)
                assert K.mean_reduce(rows[:n], out=out, op=op) is out and out.tobytes() == want.tobytes()
            assert (dt is np.float64, n) in ext.threaded_reduce_entries()
        bad = [r.copy() for r in rows[:5]]
        bad[3][m - 1] = np.inf
        with pytest.raises(gradcoll.NonFiniteError) as ei:
            K.mean_reduce(bad)
        assert (ei.value.contributor, ei.value.index) == (3, m - 1)
    x = [rng.standard_normal(m).astype(np.float32) for _ in range(2)]
    one, two = numba_cpu.reduce_entry(np.dtype(np.float32), 1), numba_cpu.reduce_entry(np.dtype(np.float32), 2)
    ext.set_threaded_reduce(False, 2, one, numba_cpu.PARALLEL_ELEMS)  # the 1-input kernel where 2 inputs go
    try:
        got = K.mean_reduce(x)
    finally:
        ext.set_threaded_reduce(False, 2, two, numba_cpu.PARALLEL_ELEMS)
    assert got.tobytes() == (x[0] * np.float32(0.5)).tobytes()  # only the first input, halved: the entry ran
    assert K.mean_reduce(x).tobytes() == ((x[0] + x[1]) * np.float32(0.5)).tobytes()
    with pytest.raises(ValueError, match="1 to 8 inputs"):
        ext.set_threaded_reduce(False, 9, two, numba_cpu.PARALLEL_ELEMS)


@pytest.mark.skipif(not {"cython", "numba"} <= set(AVAILABLE), reason="needs the compiled extension and Numba: "
                    "pip install -e . with numba installed")
def test_large_accumulates_and_wire_kernels_run_the_threaded_kernels_from_c() -> None:
    """The same for the accumulate (float32, float64; a divisor that multiplies, one that divides, a scale) and
    the wire formats' encode and accumulate: the reference's bits on the first call and on the later ones
    (which run the C entry), a non-finite value located, and the registered entry is what runs."""
    from gradcoll.kernels import lowp_reference, numba_lowp, reference
    from gradcoll.kernels._compiled import extension

    resolve("accumulate", LARGE)
    ext = extension()
    rng = np.random.default_rng(6)
    m = LARGE + 9
    for dt in (np.float32, np.float64):
        acc0, x = rng.standard_normal(m).astype(dt), rng.standard_normal(m).astype(dt)
        for scale, div in ((None, None), (None, 4), (None, 3), (0.3, None), (0.3, 3)):
            want = acc0.copy()
            assert reference.accumulate(want, x, scale, div, True)
            for _ in range(2):
                got = acc0.copy()
                K.accumulate(got, x, scale=scale, divide_by=div)
                assert got.tobytes() == want.tobytes(), (dt, scale, div)
        bad = x.copy()
        bad[m - 3] = -np.inf
        with pytest.raises(gradcoll.NonFiniteError) as ei:
            K.accumulate(acc0.copy(), bad)
        assert ei.value.index == m - 3
    assert {"accumulate_f32", "accumulate_f64"} <= set(ext.threaded_entries())
    src = rng.standard_normal(m).astype(np.float32)
    acc0 = rng.standard_normal(m).astype(np.float32)
    for wire in ("bf16", "fp16"):
        ref = np.empty(m, np.uint16)
        lowp_reference.lowp_encode(src, ref, wire, True)
        for _ in range(2):
            assert K.encode_wire(src, wire=wire).tobytes() == ref.tobytes(), wire
        for div in (None, 2, 3):
            want = acc0.copy()
            lowp_reference.lowp_accumulate(want, ref, wire, div, True)
            for _ in range(2):
                got = acc0.copy()
                K.accumulate_wire(got, ref, wire, divide_by=div)
                assert got.tobytes() == want.tobytes(), (wire, div)
        nan = src.copy()
        nan[m - 5] = np.nan
        with pytest.raises(gradcoll.NonFiniteError) as ei:
            K.encode_wire(nan, wire=wire)
        assert ei.value.index == m - 5
        assert {f"encode_{wire}", f"accumulate_{wire}"} <= set(ext.threaded_entries())
    fp16 = np.empty(m, np.uint16)
    lowp_reference.lowp_encode(src, fp16, "fp16", True)
    ext.set_threaded_entry("encode_bf16", numba_lowp.entry("encode_fp16"), numba_lowp.PARALLEL_ELEMS)
    try:
        got = K.encode_wire(src, wire="bf16")  # the fp16 kernel where bf16 calls go: the entry ran
    finally:
        ext.set_threaded_entry("encode_bf16", numba_lowp.entry("encode_bf16"), numba_lowp.PARALLEL_ELEMS)
    assert got.tobytes() == fp16.tobytes()
    with pytest.raises(ValueError, match="unknown threaded entry 'encode_int8'"):
        ext.set_threaded_entry("encode_int8", 0, 1)
