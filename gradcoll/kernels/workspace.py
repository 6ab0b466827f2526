"""Scratch buffers reused across calls, so that a hot loop allocates nothing.

Memory only, no I/O: the collectives (``workspace=`` of the algorithms, one
per process group) and the coordinator's front end use it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Workspace"]


class Workspace:
    """Scratch buffers reused across calls (so the hot loop allocates nothing).

    One per process group (or coordinator); not thread-safe (a group runs one collective at a time).
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, np.dtype], np.ndarray] = {}
        self._views: dict[tuple[str, Any, Any], np.ndarray] = {}  # (name, shape, dtype) as asked -> view

    def get(self, name: str, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised array of ``shape``, backed by a buffer kept under ``name``."""
        view = self._views.get((name, shape, dtype))
        if view is not None:  # the common case: the same collective again
            return view
        dt = np.dtype(dtype)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        need = 1
        for d in dims:
            need *= int(d)
        buf = self._bufs.get((name, dt))
        if buf is None or buf.size < need:
            buf = np.empty(max(need, 1), dt)
            self._bufs[(name, dt)] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
        view = buf[:need].reshape(dims)
        if len(self._views) < 64:
            self._views[(name, shape, dtype)] = view
        return view
