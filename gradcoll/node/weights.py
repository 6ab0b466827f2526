"""Weight URIs: resolve each once, keep it, hand out read-only arrays.

A stage or train spec names its arrays by URI; the node turns a URI into an
array with a *resolver*. The default resolver reads ``file://`` URIs that
point at ``.npy`` files, with ``allow_pickle=False``: a URI comes from a
peer, and nothing a peer sends is ever unpickled. A shell that fetches
weights its own way (an app bundle, a content store) passes its own
resolver; ``weight_cache`` wraps either so a URI used by several ops or
several stages is fetched once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from ..errors import UsageError

__all__ = ["Resolver", "WeightCache", "weight_cache", "load_file_uri"]

#: What a resolver is: URI in, array (or anything ``numpy.asarray`` takes) out.
Resolver = Callable[[str], Any]


def load_file_uri(uri: str) -> np.ndarray:
    """Load a ``file://`` URI naming a ``.npy`` file (never unpickling)."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        raise UsageError(f"no resolver for URI {uri!r}: the default resolver reads file:// .npy files; "
                         "pass resolve= to handle other schemes")
    if parts.netloc not in ("", "localhost"):
        raise UsageError(f"file URI {uri!r} names host {parts.netloc!r}; only local files are read")
    path = unquote(parts.path)
    try:
        arr: np.ndarray = np.load(path, allow_pickle=False)
        return arr
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load weight {uri!r}: {exc}") from exc


class WeightCache:
    """Resolves a URI once with ``resolver`` and returns the same read-only array afterwards.

    Thread-safe; ``loads`` counts how many URIs were actually resolved.
    """

    def __init__(self, resolver: Resolver | None = None) -> None:
        self._resolver: Resolver = load_file_uri if resolver is None else resolver
        self._arrays: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.loads = 0

    def __call__(self, uri: str) -> np.ndarray:
        """The array behind ``uri``, resolving it on first use."""
        if not isinstance(uri, str) or not uri:
            raise UsageError(f"weight URI must be a non-empty string, got {uri!r}")
        with self._lock:
            hit = self._arrays.get(uri)
        if hit is not None:
            return hit
        # Resolve outside the lock: a slow fetch must not block lookups of other URIs.
        arr = np.array(self._resolver(uri), copy=True)
        if arr.dtype.kind not in "fiu":
            raise UsageError(f"weight {uri!r} resolved to a {arr.dtype} array; numeric arrays only")
        arr.setflags(write=False)  # shared by every op that names it: nobody may write to it
        with self._lock:
            kept = self._arrays.setdefault(uri, arr)
            if kept is arr:
                self.loads += 1
        return kept

    def __contains__(self, uri: object) -> bool:
        with self._lock:
            return uri in self._arrays

    def __len__(self) -> int:
        with self._lock:
            return len(self._arrays)


def weight_cache(resolver: Resolver | None = None) -> WeightCache:
    """A cache that resolves each weight URI once (``file://`` .npy by default, else ``resolver``)."""
    if isinstance(resolver, WeightCache):
        return resolver
    return WeightCache(resolver)
