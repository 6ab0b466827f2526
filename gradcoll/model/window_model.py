"""The direct allreduce's choice of schedule, from the stored measurements of the shared window.

The window's entry sits under ``WINDOW_MODEL`` in ``fitted.json``, written by
``benches/fit_costmodel.py`` from rows of ``direct_one_shot`` and
``direct_two_shot`` (each schedule forced, every size): its
``one_shot_bytes`` holds, per world size measured, the largest size up to
which one-shot was never slower than two-shot by more than ``TOLERANCE``
(at that size and every smaller one). Where one-shot gives way to two-shot
depends on the cross-core traffic of the machine more than on any term the
message model has (one-shot reads every slot whole, two-shot a share of
each), so the measured crossover decides; its ``model`` (an ``AlphaBeta``
over ``costmodel.work``'s terms: alpha is one publish-and-wait) decides for
world sizes not measured beyond the largest one, and a world size between
measured ones takes the smaller one's crossover. Without an entry, the
default crossover holds.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .costmodel import DIRECT_MODES, FITTED_PATH, Node, best, crossovers, stored_models

__all__ = ["WINDOW_MODEL", "DEFAULT_ONE_SHOT_BYTES", "TOLERANCE", "direct_one_shot_bytes", "measured_crossovers"]

#: The stored entry of the shared window.
WINDOW_MODEL = "window"
#: Where one-shot gives way to two-shot when no window entry is stored (bytes).
DEFAULT_ONE_SHOT_BYTES = 64 << 10
#: How much slower than two-shot one-shot may be and still count as not slower (noise of small calls).
TOLERANCE = 0.10


def measured_crossovers(rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, int]:
    """Per world size (as a string, the JSON key), the largest size one-shot runs at: see the module docstring.

    ``rows``: ``gradcoll bench`` rows of both schedules, ``key`` the time field compared. A world size whose
    one-shot already loses at its smallest size gets that size less one (one-shot only below it).
    """
    out: dict[str, int] = {}
    for n in sorted({int(r["ranks"]) for r in rows}):
        times: dict[int, dict[str, float]] = {}
        for r in rows:
            if int(r["ranks"]) == n and r["algorithm"] in DIRECT_MODES:
                times.setdefault(int(r["size"]), {})[str(r["algorithm"])] = float(r[key])
        sizes = sorted(s for s, t in times.items() if len(t) == 2)
        if not sizes:
            continue
        limit = sizes[0] - 1
        for s in sizes:
            if times[s]["direct_one_shot"] > (1.0 + TOLERANCE) * times[s]["direct_two_shot"]:
                break
            limit = s
        out[str(n)] = limit
    return out


@functools.cache
def direct_one_shot_bytes(n: int, path: str = FITTED_PATH) -> int:
    """The largest buffer the direct allreduce runs one-shot on ``n`` ranks (see the module docstring)."""
    if n < 2:
        return DEFAULT_ONE_SHOT_BYTES
    try:
        with open(path) as f:
            entry: dict[str, Any] | None = json.load(f)["transports"].get(WINDOW_MODEL)
    except (OSError, ValueError, KeyError):
        entry = None
    if entry is None:
        return DEFAULT_ONE_SHOT_BYTES
    measured = {int(k): int(v) for k, v in entry.get("one_shot_bytes", {}).items()}
    below = [m for m in measured if m <= n]
    if below and (n <= max(measured) or "model" not in entry):
        return measured[max(below)]
    if measured and not below:
        return measured[min(measured)]
    model, cores, max_ranks = stored_models(path)[WINDOW_MODEL]
    node = Node(n, cores) if cores is not None and n <= max_ranks else None
    for at, before, after in crossovers(model, n, lo=1 << 10, hi=1 << 30, algorithms=DIRECT_MODES, node=node):
        if before == "direct_one_shot" and after == "direct_two_shot":
            return at - 4
    return (1 << 30) if best(n, 1 << 20, model, DIRECT_MODES, node=node) == "direct_one_shot" else 0
