"""An alpha-beta-gamma cost model of the allreduce algorithms (docs/scaling.md).

A transport is described by three numbers (:class:`AlphaBeta`):

* ``alpha_s``: fixed cost of one message on the critical path (latency plus
  per-message software overhead), seconds;
* ``beta_s_per_byte``: seconds per byte pushed through one rank's link
  (1 / bandwidth; a rank's sends share its egress, its receives its ingress);
* ``gamma_s_per_byte``: seconds per byte of incoming contribution added into
  a partial sum by the reduction kernel.

:func:`terms` gives, for one algorithm, world size and buffer size, the
number of messages, link bytes and reduced bytes on the critical path, so the
predicted time is ``alpha * m + beta * b + gamma * r`` (:func:`predict`):

* ``ring``: ``2 (n-1)`` steps of ``S/n`` bytes, ``n-1`` of them followed by
  the reduction of ``S/n`` bytes. The model treats each step as one message
  (it ignores the segment pipelining of :mod:`gradcoll.algorithms.ring`, which
  can hide part of the reduction behind the next transfer).
* ``star``: rank 0 receives ``(n-1) S`` through its ingress, adds ``(n-1) S``
  and sends ``(n-1) S`` through its egress; two message latencies.
* ``recursive_doubling``: ``log2 p`` exchanges of ``S`` bytes, each followed
  by the reduction of ``S`` bytes (``p`` the largest power of two <= n); when
  ``n`` is not a power of two, a fold (``S`` bytes, reduced) and an unfold
  (``S`` bytes) more.

:func:`fit` estimates the three numbers from ``gradcoll bench --json`` rows
of several algorithms and sizes by least squares on these terms (relative
residuals, so small and large sizes weigh alike; a parameter that comes out
negative is dropped and the rest refitted). :func:`crossovers` lists the
sizes where the fastest algorithm changes. The simulated transport
:mod:`gradcoll.transport.sim` runs the real algorithm code against the same
model; its virtual times equal these closed forms.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import UsageError

__all__ = ["AlphaBeta", "ALGORITHMS", "terms", "predict", "best", "fit", "crossovers", "busbw", "link_model"]

#: The algorithms the model covers.
ALGORITHMS = ("ring", "star", "recursive_doubling")


@dataclass(frozen=True)
class AlphaBeta:
    """Per-message latency, seconds per link byte, seconds per reduced byte."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float

    def describe(self) -> str:
        """``alpha 12.3 us, beta 1.05 GB/s, gamma 4.2 GB/s`` (bandwidths as 1/beta, 1/gamma)."""
        def bw(x: float) -> str:
            return "inf" if x <= 0 else f"{1 / x / 1e9:.3g} GB/s"
        return f"alpha {self.alpha_s * 1e6:.3g} us, beta {bw(self.beta_s_per_byte)}, gamma {bw(self.gamma_s_per_byte)}"


def link_model(gbit_per_s: float, alpha_s: float, reduce_bytes_per_s: float) -> AlphaBeta:
    """A model for a network link of ``gbit_per_s`` with latency ``alpha_s`` and a kernel of given throughput."""
    return AlphaBeta(alpha_s, 8.0 / (gbit_per_s * 1e9), 1.0 / reduce_bytes_per_s)


def terms(algorithm: str, n: int, nbytes: float) -> tuple[float, float, float]:
    """(messages, link bytes, reduced bytes) on the critical path of one allreduce."""
    if n < 1:
        raise UsageError(f"world size must be >= 1, got {n}")
    if n == 1:
        return 0.0, 0.0, 0.0
    s = float(nbytes)
    if algorithm == "ring":
        c = s / n
        return 2.0 * (n - 1), 2.0 * (n - 1) * c, (n - 1) * c
    if algorithm == "star":
        return 2.0, 2.0 * (n - 1) * s, (n - 1) * s
    if algorithm == "recursive_doubling":
        p = 1 << (n.bit_length() - 1)
        rounds = p.bit_length() - 1
        m, b, r = float(rounds), rounds * s, rounds * s
        if n != p:
            m, b, r = m + 2, b + 2 * s, r + s
        return m, b, r
    raise UsageError(f"unknown algorithm {algorithm!r}; the model covers {', '.join(ALGORITHMS)}")


def predict(algorithm: str, n: int, nbytes: float, model: AlphaBeta) -> float:
    """Predicted seconds for one allreduce of ``nbytes`` on ``n`` ranks."""
    m, b, r = terms(algorithm, n, nbytes)
    return model.alpha_s * m + model.beta_s_per_byte * b + model.gamma_s_per_byte * r


def busbw(nbytes: float, n: int, seconds: float) -> float:
    """nccl-tests bus bandwidth in bytes/s: ``S / t * 2 (n-1) / n``."""
    return nbytes / seconds * (2 * (n - 1) / n if n > 1 else 1.0)


def best(n: int, nbytes: float, model: AlphaBeta, algorithms: Sequence[str] = ALGORITHMS) -> str:
    """The algorithm with the lowest predicted time (first listed wins ties)."""
    return min(algorithms, key=lambda a: predict(a, n, nbytes, model))


def fit(rows: Iterable[Mapping[str, Any]], *, time_key: str = "time_avg_us") -> AlphaBeta:
    """Least-squares fit of (alpha, beta, gamma) to ``gradcoll bench --json`` rows.

    Each row needs ``algorithm`` (one of :data:`ALGORITHMS`), ``ranks``,
    ``size`` and ``time_key`` (microseconds). Residuals are relative to the
    measured time. Rows of at least two algorithms (or two world sizes) are
    needed to tell beta from gamma.
    """
    a_rows: list[tuple[float, float, float]] = []
    t_rows: list[float] = []
    for row in rows:
        algo = str(row["algorithm"])
        if algo not in ALGORITHMS:
            raise UsageError(f"row has algorithm {algo!r}; fit needs rows of {', '.join(ALGORITHMS)}")
        a_rows.append(terms(algo, int(row["ranks"]), float(row["size"])))
        t_rows.append(float(row[time_key]) * 1e-6)
    if len(t_rows) < 3:
        raise UsageError(f"fit needs at least 3 rows, got {len(t_rows)}")
    t = np.asarray(t_rows)
    a = np.asarray(a_rows) / t[:, None]  # relative residuals
    y = np.ones_like(t)
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))  # the most negative parameter goes to zero
    return AlphaBeta(float(coef[0]), float(coef[1]), float(coef[2]))


def crossovers(model: AlphaBeta, n: int, *, lo: int = 1 << 10, hi: int = 1 << 30,
               algorithms: Sequence[str] = ALGORITHMS) -> list[tuple[int, str, str]]:
    """``(nbytes, before, after)`` for every size in ``[lo, hi]`` where the fastest algorithm changes.

    The size is the smallest multiple of 4 bytes (one float32) at which ``after`` wins.
    """
    out: list[tuple[int, str, str]] = []
    steps = 64 * max(1, int(math.log2(hi / lo)))
    grid = sorted({int(round(lo * (hi / lo) ** (i / steps))) // 4 * 4 for i in range(steps + 1)})
    prev = best(n, grid[0], model, algorithms)
    for a, b in zip(grid, grid[1:], strict=False):
        cur = best(n, b, model, algorithms)
        if cur != prev:
            left, right = a, b  # best(left) == prev, best(right) == cur
            while right - left > 4:
                mid = (left + right) // 8 * 4
                if best(n, mid, model, algorithms) == prev:
                    left = mid
                else:
                    right = mid
            out.append((right, prev, best(n, right, model, algorithms)))
            prev = cur
    return out
