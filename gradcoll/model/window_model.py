"""The direct allreduce's choice of schedule, from the stored model of the shared window.

The window's model is an ``AlphaBeta`` stored under ``WINDOW_MODEL`` in
``fitted.json`` (its alpha is one publish-and-wait, not a message), fitted to
rows of ``direct_one_shot`` and ``direct_two_shot`` (``costmodel.work`` has
their terms). Without one, the default crossover holds.
"""

from __future__ import annotations

import functools

from .costmodel import DIRECT_MODES, FITTED_PATH, Node, best, crossovers, stored_models

__all__ = ["WINDOW_MODEL", "DEFAULT_ONE_SHOT_BYTES", "direct_one_shot_bytes"]

#: The stored model of the shared window.
WINDOW_MODEL = "window"
#: Where one-shot gives way to two-shot when no window model is stored (bytes).
DEFAULT_ONE_SHOT_BYTES = 64 << 10


@functools.cache
def direct_one_shot_bytes(n: int, path: str = FITTED_PATH) -> int:
    """The largest buffer the direct allreduce runs one-shot on ``n`` ranks: below the stored window model's
    crossover to two-shot (``DEFAULT_ONE_SHOT_BYTES`` without one)."""
    models = stored_models(path)
    entry = models.get(WINDOW_MODEL)
    if entry is None or n < 2:
        return DEFAULT_ONE_SHOT_BYTES
    model, cores, max_ranks = entry
    node = Node(n, cores) if cores is not None and n <= max_ranks else None
    for at, before, after in crossovers(model, n, lo=1 << 10, hi=1 << 30, algorithms=DIRECT_MODES, node=node):
        if before == "direct_one_shot" and after == "direct_two_shot":
            return at - 4
    return (1 << 30) if best(n, 1 << 20, model, DIRECT_MODES, node=node) == "direct_one_shot" else 0
