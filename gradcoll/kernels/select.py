"""Backend registry: which kernel implementations load here, and which to use.

Backends are imported on first use, never at ``import gradcoll``. A backend
that fails to load is reported with its original exception chained.

Selection for ``backend=None`` (measured on the 2-core CI machine, see
docs/performance.md): the compiled Cython kernels up to
``SMALL_ELEMS`` output elements (no JIT dispatch, lowest per-call cost),
Numba above that (serial up to its own parallel threshold, then threads),
NumPy when neither loads. Device arrays go to the CUDA backend.
``GRADCOLL_KERNELS=numba|cython|numpy|cuda|cudasim`` overrides the choice.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

from ..errors import BackendUnavailable, UsageError

__all__ = [
    "BACKENDS",
    "load_backend",
    "available_backends",
    "choose_backend",
    "env_override",
    "env_override_set",
    "SMALL_ELEMS",
]

#: Every backend gradcoll knows, in order of preference for host arrays.
BACKENDS = ("cython", "numba", "numpy", "cuda", "cudasim")

#: Below this many output elements the Cython path wins (measured).
SMALL_ELEMS = 16384

_MODULES = {
    "numpy": "gradcoll.kernels.numpy_backend",
    "numba": "gradcoll.kernels.numba_cpu",
    "cython": "gradcoll.kernels.cython_backend",
    "cuda": "gradcoll.kernels.cuda",
    "cudasim": "gradcoll.kernels.cuda",
}


@functools.cache
def _load(name: str) -> ModuleType | BaseException:
    try:
        mod = importlib.import_module(_MODULES[name])
        probe = getattr(mod, "probe", None)
        if probe is not None:
            probe(name)
        return mod
    except Exception as exc:  # remembered, re-raised with context by load_backend
        return exc


def load_backend(name: str) -> ModuleType:
    """Return the backend module ``name``, or raise BackendUnavailable chaining the cause."""
    if name not in _MODULES:
        raise UsageError(f"unknown kernel backend {name!r}; known: {', '.join(BACKENDS)}")
    res = _load(name)
    if isinstance(res, BaseException):
        raise BackendUnavailable(f"kernel backend {name!r} is not available here: {res}") from res
    return res


def available_backends() -> list[str]:
    """Names of the backends that load on this machine, best first for host arrays."""
    return [b for b in BACKENDS if not isinstance(_load(b), BaseException)]


def env_override_set() -> bool:
    """Cheap test for a non-empty GRADCOLL_KERNELS (on the per-call hot path).

    ``os.environ.get`` encodes the key on every call (~0.5 us); the encoded
    mapping behind ``os.environ`` is kept in sync by it, so look there.
    """
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict) and os.name != "nt":
        return bool(data.get(b"GRADCOLL_KERNELS"))
    return bool(os.environ.get("GRADCOLL_KERNELS"))


def env_override() -> str | None:
    """The backend named by GRADCOLL_KERNELS, if set."""
    name = os.environ.get("GRADCOLL_KERNELS", "").strip().lower()
    return name or None


def choose_backend(nelems: int, *, device: bool = False, backend: str | None = None) -> ModuleType:
    """Pick the backend module for a buffer of ``nelems`` output elements."""
    if backend is None:
        backend = env_override()
    if backend is not None:
        return load_backend(backend)
    if device:
        for name in ("cuda", "cudasim"):
            mod = _load(name)
            if not isinstance(mod, BaseException):
                return mod
        return load_backend("cuda")
    order = ("cython", "numba", "numpy") if nelems <= SMALL_ELEMS else ("numba", "cython", "numpy")
    for name in order:
        mod = _load(name)
        if not isinstance(mod, BaseException):
            return mod
    return load_backend("numpy")
