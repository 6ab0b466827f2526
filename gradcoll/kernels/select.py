"""The one kernel selection policy: which implementation runs each call of ``gradcoll.kernels``.

Every facade function asks [`resolve`][gradcoll.kernels.select.resolve] with
the call's *kind*, its number of output elements, whether its arrays live on a
GPU, and the ``backend=`` it was given. Kinds: ``reduce``
([`mean_reduce`][gradcoll.kernels.mean_reduce]), ``accumulate``, ``finite``
([`check_finite`][gradcoll.kernels.check_finite]), ``scale``, ``lowp``
([`encode_wire`][gradcoll.kernels.encode_wire], [`decode_wire`][gradcoll.kernels.decode_wire],
[`accumulate_wire`][gradcoll.kernels.accumulate_wire]) and ``exact``
([`exact_reduce`][gradcoll.kernels.exact_reduce]).

The request is ``backend=`` when given: a name, or an object implementing the
backend protocol (``gradcoll.kernels.protocol``), which then gets every call.
Without it, ``GRADCOLL_KERNELS=numba|cython|numpy|cuda|cudasim`` names the
backend; without that, the choice is automatic. The table (``POLICY``, with
``HALF`` and ``DEVICE``, in the code) lists for each the backends to try; the
first that implements the kind on this machine runs (a single name that does not load raises
[`BackendUnavailable`][gradcoll.errors.BackendUnavailable] with the cause):

| kind | automatic, up to `SMALL_ELEMS` | automatic, larger | `cython` | `numba` | `numpy` | `cuda`, `cudasim` |
|---|---|---|---|---|---|---|
| reduce, accumulate, finite, scale | cython, numba, numpy | numba, cython, numpy | cython | numba | numpy | that one |
| the same on float16 (not reduce) | numpy | numpy | numpy | numpy | numpy | numpy |
| lowp (bf16 wire) | cython, numba, numpy | numba, cython, numpy | cython, numba, numpy | numba, numpy | numpy | that one |
| lowp, fp16 wire | cython, numba, numpy | numba, cython, numpy | cython, numba, numpy | numba, numpy | numpy | that one |
| exact | numba, numpy | numba, numpy | numba, numpy | numba, numpy | numpy | numba, numpy |

Device arrays go to ``cuda``, else ``cudasim`` (``GRADCOLL_KERNELS`` naming a
host backend does not apply to them); ``backend="cuda"`` or ``"cudasim"``
picks one, and a host backend named in ``backend=`` is a
[`UsageError`][gradcoll.errors.UsageError].

Why: the Cython kernels (serial, the same one-pass loops as Numba's) have
the lowest per-call cost (no JIT dispatch), so they win up to ``SMALL_ELEMS``
output elements; above it the threaded Numba kernels do, both cores working
(docs/performance.md). The bf16 kernels follow the same rule: above
``SMALL_ELEMS`` the threaded Numba encode (no NaN select when checking) and
accumulate beat the serial compiled ones. For the fp16 wire format
(``half=True``: the facade passes it) the threaded Numba kernels run the
extension's own F16C loops, block by block under ``prange``, where the
extension is built: Numba converts one value at a time (a branch-free
select of three ranges to encode, a table lookup to widen), slower than the
serial compiled loops, which convert 8 values per instruction.
A process group
names ``cython`` (its ``kernel_backend``): every rank is a process on its
own core, and threads would only compete for them. The compiled kernels
take float32 and float64 only, so half buffers go to NumPy (``mean_reduce``
widens half inputs to float32 first). There are no Cython or CUDA exact
kernels, and a process group passes its ``kernel_backend`` to every
collective, so ``exact`` falls back, to the Numba kernels and then the NumPy
reference, which give the same bits.

Fast path: where the table picks ``cython`` for ``reduce``, ``accumulate``
or ``lowp`` (``encode_wire``, ``accumulate_wire``), the facade first offers
the call to the extension's validating entry
([`fast_path`][gradcoll.kernels.select.fast_path]): one C call that checks
plain arrays and runs the kernel (no Python frame in between); anything
it does not take (a 2-D input, float16, a non-contiguous array, a NaN to
explain) goes the general way, through the same table.

``GRADCOLL_KERNELS`` is read on every call, so a test can set it and get that
backend. On the fast path it is read with C ``getenv`` (the extension's
``kernels_env``): ``os.environ.get`` of an unset name raises and catches a
KeyError, which costs as much as the whole call. ``os.environ``
writes through ``putenv``/``unsetenv``, so the C environment sees every change
made through it. Without the extension there is no fast path, the variable is
read with ``os.environ.get``, and a call costs microseconds of JIT dispatch
anyway.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..errors import BackendUnavailable, UsageError
from ._compiled import extension
from .protocol import KIND_METHODS

__all__ = [
    "BACKENDS",
    "KINDS",
    "POLICY",
    "DEVICE",
    "SMALL_ELEMS",
    "REDUCE_SMALL_ELEMS",
    "reduce_elems",
    "resolve",
    "candidates",
    "implementation",
    "fast_path",
    "load_backend",
    "available_backends",
    "choose_backend",
    "env_override",
    "env_override_set",
    "kernels_env",
]

#: Every backend gradcoll knows, in order of preference for host arrays.
BACKENDS = ("cython", "numba", "numpy", "cuda", "cudasim")
#: The kinds of kernel call (see the module docstring).
KINDS = ("reduce", "accumulate", "finite", "scale", "lowp", "exact")
#: Up to this many output elements the automatic choice is Cython: above it the threaded accumulate, the
#: wire formats' encode and accumulate and the threaded finite check take less time than the serial loops,
#: now that the fast entries call the threaded kernels' C entries with no Python in between (docs/kernels.md,
#: "The threaded kernels without Python") and the threads' blocks are split evenly ("An even split").
SMALL_ELEMS = 1 << 16
#: The reduce's limit for 2 inputs; n inputs move (n + 1) / 3 times the bytes, so their limit is 3 / (n + 1)
#: of it (``reduce_elems``). The threaded reduce overtakes the serial one where the inputs and the output stop
#: fitting in one core's L2 cache, sooner the more inputs there are (docs/kernels.md, "Where threads pay off").
REDUCE_SMALL_ELEMS = 1 << 16


def reduce_elems(m: int, n: int) -> int:
    """The size class of a reduce of ``n`` inputs into ``m`` outputs, on the scale of ``SMALL_ELEMS`` (what
    ``resolve("reduce", ...)`` takes): above ``SMALL_ELEMS`` exactly when ``m`` is above its limit."""
    return m * (n + 1) * SMALL_ELEMS // (3 * REDUCE_SMALL_ELEMS)

Chains = tuple[tuple[str, ...], tuple[str, ...]]  # (up to SMALL_ELEMS, larger)


def _both(*names: str) -> Chains:
    return names, names


_ELEMENTWISE: dict[str | None, Chains] = {
    None: (("cython", "numba", "numpy"), ("numba", "cython", "numpy")),
    **{name: _both(name) for name in BACKENDS},
}
_TO_NUMBA = _both("numba", "numpy")

#: kind -> request (a backend name, or None for automatic) -> the backends to try, by size class.
POLICY: dict[str, dict[str | None, Chains]] = {
    "reduce": _ELEMENTWISE,
    "accumulate": _ELEMENTWISE,
    "finite": _ELEMENTWISE,
    "scale": _ELEMENTWISE,
    "lowp": {None: (("cython", "numba", "numpy"), ("numba", "cython", "numpy")), "cython": _both("cython", "numba", "numpy"), "numba": _TO_NUMBA,
             "numpy": _both("numpy"), "cuda": _both("cuda"), "cudasim": _both("cudasim")},
    "exact": {None: _TO_NUMBA, "cython": _TO_NUMBA, "numba": _TO_NUMBA, "numpy": _both("numpy"),
              "cuda": _TO_NUMBA, "cudasim": _TO_NUMBA},
}
#: Float16 host buffers of these kinds, whatever was asked for: the compiled kernels take float32/float64.
HALF: dict[str, tuple[str, ...]] = {"accumulate": ("numpy",), "finite": ("numpy",), "scale": ("numpy",)}
#: The fp16 wire format of ``lowp`` (``half=True``), by request: as bf16 (the threaded kernels run the F16C loops).
FP16_WIRE: dict[str | None, Chains] = {None: (("cython", "numba", "numpy"), ("numba", "cython", "numpy"))}
#: Device arrays: request -> the backends to try.
DEVICE: dict[str | None, tuple[str, ...]] = {None: ("cuda", "cudasim"), "cuda": ("cuda",), "cudasim": ("cudasim",)}

_FAMILY = {"reduce": "host", "accumulate": "host", "finite": "host", "scale": "host", "lowp": "lowp", "exact": "exact"}
#: family -> backend -> the module (in gradcoll.kernels) holding that backend's kernels of that family of kinds.
_MODULES = {
    "host": {"numpy": "numpy_backend", "numba": "numba_cpu", "cython": "cython_backend", "cuda": "cuda", "cudasim": "cuda"},
    "lowp": {"numpy": "lowp_reference", "numba": "numba_lowp", "cython": "cython_lowp", "cuda": "cuda", "cudasim": "cuda"},
    "exact": {"numpy": "exact_reference", "numba": "numba_exact"},
}
#: The extension's validating entries per kind (see ``fast_path``).
_FAST = {"reduce": ("reduce_fast",), "accumulate": ("accumulate_fast",),
         "lowp": ("lowp_encode_fast", "lowp_accumulate_fast")}
_NO_LIMIT = 1 << 62


@functools.cache
def _load(name: str, family: str = "host") -> ModuleType | BaseException:
    """Import a backend's module (once): the module, or the exception that stopped it (kept for the error)."""
    module = _MODULES[family].get(name)
    if module is None:
        return BackendUnavailable(f"kernel backend {name!r} has no {family} kernels")
    try:
        mod = importlib.import_module(f"gradcoll.kernels.{module}")  # by name: on first use, never at import gradcoll
        probe = getattr(mod, "probe", None)
        if probe is not None:
            probe(name)
        return mod
    except Exception as exc:  # remembered, re-raised with context by the caller
        return exc


def implementation(name: str, kind: str = "reduce") -> ModuleType:
    """The module of backend ``name`` for ``kind``; raises BackendUnavailable chaining the cause."""
    if name not in BACKENDS:
        raise UsageError(f"unknown kernel backend {name!r}; known: {', '.join(BACKENDS)}")
    res = _load(name, _FAMILY[kind])
    if isinstance(res, BaseException):
        raise BackendUnavailable(f"kernel backend {name!r} is not available here: {res}") from res
    return res


def load_backend(name: str) -> ModuleType:
    """Return the backend module ``name`` (its host kernels), or raise BackendUnavailable chaining the cause."""
    return implementation(name, "reduce")


def available_backends() -> list[str]:
    """Names of the backends that load on this machine, best first for host arrays."""
    return [b for b in BACKENDS if not isinstance(_load(b), BaseException)]


def _env_py() -> str | None:
    return os.environ.get("GRADCOLL_KERNELS", "").strip().lower() or None


def _env_first() -> str | None:
    global kernels_env
    ext = extension()
    kernels_env = getattr(ext, "kernels_env", _env_py)  # C getenv when built (module docstring)
    return kernels_env()


#: The backend named by GRADCOLL_KERNELS (stripped, lower case), or None; cheap enough for every call.
kernels_env: Callable[[], str | None] = _env_first


def env_override() -> str | None:
    """The backend named by GRADCOLL_KERNELS, if set."""
    return kernels_env()


def env_override_set() -> bool:
    """True when GRADCOLL_KERNELS names a backend."""
    return kernels_env() is not None


def candidates(kind: str, name: str | None, nelems: int = 0, *, device: bool = False,
               half: bool = False) -> tuple[str, ...]:
    """The backends ``POLICY`` lists for this call, in order (``name``: the request, after GRADCOLL_KERNELS)."""
    if kind not in POLICY:
        raise UsageError(f"unknown kernel kind {kind!r}; known: {', '.join(KINDS)}")
    if name is not None and name not in BACKENDS:
        raise UsageError(f"unknown kernel backend {name!r}; known: {', '.join(BACKENDS)}")
    if device:
        if name not in DEVICE:
            raise UsageError(f"kernel backend {name!r} takes host arrays; device arrays need 'cuda' or 'cudasim'")
        return DEVICE[name]
    if half and kind in HALF:
        return HALF[kind]
    if half and kind == "lowp" and name in FP16_WIRE:
        return FP16_WIRE[name][nelems > SMALL_ELEMS]
    return POLICY[kind][name][nelems > SMALL_ELEMS]


_RESOLVED: dict[tuple[str, str | None, bool, bool, bool], Any] = {}


def resolve(kind: str, nelems: int = 0, *, device: bool = False, backend: Any = None, half: bool = False) -> Any:
    """The implementation of ``kind`` for a call on ``nelems`` output elements: a module, or ``backend`` itself.

    ``backend``: a name, an object (returned as is once it has the kind's methods), or None (GRADCOLL_KERNELS,
    then automatic). ``half``: the buffer is float16 (for ``lowp``: the wire format is fp16). Resolutions are remembered (a backend's availability does
    not change in a process), so a call costs a dictionary lookup.
    """
    if backend is not None and not isinstance(backend, str):
        for method in KIND_METHODS[kind][device]:
            if not hasattr(backend, method):
                raise UsageError(f"kernel backend {backend!r} has no {method}() for the {kind} kernels "
                                 f"(see gradcoll.kernels.protocol)")
        return backend
    name = backend if backend is not None else kernels_env()
    if device and backend is None and name not in DEVICE:
        name = None  # GRADCOLL_KERNELS naming a host backend does not move device arrays
    key = (kind, name, device, nelems > SMALL_ELEMS, half)
    impl = _RESOLVED.get(key)
    if impl is None:
        impl = _pick(kind, candidates(kind, name, nelems, device=device, half=half), device)
        _RESOLVED[key] = impl
    return impl


def _pick(kind: str, names: tuple[str, ...], device: bool) -> ModuleType:
    family = "host" if device else _FAMILY[kind]
    first: BaseException | None = None
    for name in names:
        res = _load(name, family)
        if not isinstance(res, BaseException):
            if name == "numba" and not device:
                _threaded(extension())  # from now on the fast entries hand it their large calls
            return res
        first = first or res
    raise BackendUnavailable(f"kernel backend {names[0]!r} is not available here: {first}") from first


FastEntry = tuple[Any, ...] | None  # (entry, ..., the most elements it may take)
#: kind -> request -> the fast path of ``fast_path`` (filled on first use: the extension loads then).
_FAST_CACHE: dict[str, dict[str | None, FastEntry]] = {kind: {} for kind in _FAST}


def fast_path(kind: str, backend: Any = None) -> FastEntry:
    """The extension's validating entries for ``kind`` and the most elements they may take, or None.

    ``(reduce_fast, limit)``, ``(accumulate_fast, limit)``, ``(lowp_encode_fast, lowp_accumulate_fast,
    bf16 limit, fp16 limit)``. There are some where ``POLICY`` picks ``cython`` for this request and the extension is built: up to
    ``SMALL_ELEMS`` for the automatic choice, any size when ``cython`` is named. The entry returns None for a
    call it does not take, which then goes through ``resolve``. On every small call: two dictionary lookups.
    """
    if backend is None:
        backend = kernels_env()
    elif type(backend) is not str:
        return None  # an injected backend gets every call
    try:
        return _FAST_CACHE[kind][backend]
    except KeyError:  # first call for this kind and request (or a kind without a fast path)
        pass
    cache = _FAST_CACHE.get(kind)
    if cache is None:
        return None
    entry = _fast_entry(kind, backend)
    if backend is None or backend in BACKENDS:  # unknown names are not remembered (resolve rejects them)
        cache[backend] = entry
    return entry


def _fast_entry(kind: str, backend: str | None) -> FastEntry:
    chains = POLICY[kind].get(backend)
    ext = extension()
    if chains is None or ext is None or isinstance(_load("cython", _FAMILY[kind]), BaseException):
        return None
    fns = tuple(getattr(ext, name) for name in _FAST[kind])
    limits = [_limit(chains)]
    if kind == "reduce" and limits[0] == SMALL_ELEMS:
        limits[0] = REDUCE_SMALL_ELEMS
    if kind == "lowp":  # a second limit for the fp16 wire format
        limits.append(_limit(FP16_WIRE.get(backend, chains)))
    if limits[0] == 0:
        return None
    return (*fns, *limits)


@functools.cache
def _threaded(ext: Any) -> None:
    """Hand the extension's fast entries the threaded Numba kernels for the calls above their limit (once, when a
    call first resolves to Numba: a process that never needs it never imports it).

    A fast entry has a limit only where the automatic choice moves from ``cython`` to ``numba`` (``_limit``);
    above it the entry still validates the call in C and then runs these, so a large call skips the facade's
    Python checks, which run with the cache the previous call's megabytes evicted (docs/kernels.md).
    """
    if ext is None or not hasattr(ext, "set_threaded"):
        return
    host, lowp = _load("numba"), _load("numba", "lowp")
    if isinstance(host, BaseException) or isinstance(lowp, BaseException):
        return
    ext.set_threaded(host.reduce_plain, host.GROUP, host.accumulate, lowp.lowp_encode, lowp.lowp_accumulate)
    if hasattr(ext, "set_threaded_reduce") and hasattr(host, "reduce_entry"):  # then the reduce's C entries
        setattr(host, "_register", functools.partial(_register_entry, ext, host.PARALLEL_ELEMS))  # noqa: B010
    if hasattr(ext, "set_threaded_entry"):  # and those of the accumulate and the low-precision kernels
        for mod in (host, lowp):
            if hasattr(mod, "_register_entry"):
                setattr(mod, "_register_entry",  # noqa: B010
                        functools.partial(_register_named, ext, mod.PARALLEL_ELEMS))


def _register_entry(ext: Any, parallel_elems: int, double: bool, n: int, address: int) -> None:
    ext.set_threaded_reduce(double, n, address, parallel_elems)


def _register_named(ext: Any, parallel_elems: int, name: str, address: int) -> None:
    ext.set_threaded_entry(name, address, parallel_elems)


def _limit(chains: Chains) -> int:
    """The most elements the fast path may take where ``chains`` is the policy: as far as it picks ``cython``."""
    return _NO_LIMIT if chains[1][0] == "cython" else SMALL_ELEMS if chains[0][0] == "cython" else 0


def choose_backend(nelems: int, *, device: bool = False, backend: Any = None) -> Any:
    """The implementation of a ``reduce`` of ``nelems`` output elements (``resolve("reduce", ...)``)."""
    return resolve("reduce", nelems, device=device, backend=backend)
