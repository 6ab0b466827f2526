"""An alpha-beta-gamma cost model of the allreduce algorithms (docs/scaling.md).

A transport is described by ``AlphaBeta``:

* ``alpha_s``: fixed cost of one message on the critical path (latency plus per-message software overhead),
  seconds;
* ``beta_s_per_byte``: seconds per byte through one rank's link (1 / bandwidth). Full duplex: a rank's sends
  share its egress, its receives its ingress. Zero for loopback transports, which have no link;
* ``gamma_s_per_byte``: seconds per byte of incoming contribution added into a partial sum by the reduction
  kernel (CPU);
* ``delta_s_per_byte``: CPU seconds per byte a rank copies into or out of the transport (the send side's copy
  in, the receive side's copy out, and the star root's copy of its own input). On the rank's own core, so a
  rank's sends and receives add up (half duplex); zero for a link whose transfers cost no CPU;
* ``switch_s``: per message on the critical path, the extra cost of waking a descheduled peer when a node runs
  more ranks than it has cores, times ``ranks / cores - 1``;
* ``mem_s_per_byte`` and ``cache_bytes``: the extra CPU cost per byte (copied or reduced) of the part of the
  node's working set (``S`` times the ranks on the node) that does not fit in ``cache_bytes``.
* ``l2_s_per_byte`` and ``l2_bytes``: the same for a core's own cache (level 2), whose working set is one
  message: a copy or reduction of a message of ``m`` bytes pays ``l2`` on the fraction ``max(0, 1 - l2_bytes /
  (4 m x))`` (``out_of_l2``): the core touches the message in the user buffer and in the transport's (socket
  buffer, shm segment), for the message it sends and the one it receives, and ``x`` ranks time-sharing the
  core (``max(1, ranks / cores)``) share its cache. ``l2_bytes`` is read from the machine (sysfs), not fitted;
* ``wait_share`` and ``wait_busy_s``: on a node with more ranks than cores, a rank waiting for the critical
  rank stays runnable (busy-polls or yields) for the transport's first ``wait_busy_s`` and takes
  ``wait_share`` of a core from the working ranks meanwhile, times ``ranks / cores - 1``. ``wait_busy_s`` is
  the transport's constant (shm yields for 2 ms, tcp polls 50 us), not fitted. It applies where the critical
  rank works while others wait (the star's root), not where every rank works at once (the node's shared CPU
  already counts those).
* ``piece_bytes``: where the transport runs a recursive-doubling round as one compiled step that reduces the
  peer's bytes as they arrive, with the send at most this far ahead of the receive (tcp: 1 MiB,
  ``gradcoll.transport.tcp_fast.PIECE_BYTES``), the round's per-core working set is that piece, not the
  message: the ``l2`` term counts the piece (for the rounds of the ring and halving-doubling too). The step runs where ``n`` is a power of
  two (no fold, no unfold). There, recursive doubling and halving-doubling run all their rounds in one compiled
  call (``gradcoll.transport.tcp_rounds``), and the ring does in a group of any size: ``alpha`` counts once
  per call for them, and so does ``switch`` but for the ring, whose every round waits on its left neighbour
  and so needs every rank running: it wakes one per round.
* ``round_s``: per round of such a call (the round trip of its frames), times ``max(1, ranks / cores)``: its
  waits poll and yield the core instead of sleeping, so a round costs less than an engine's message.
  Not fitted (0: the whole message).
* ``call_s``: the fixed cost of such a call, in place of ``alpha``, which stays the cost of a message
  through the transport's queues (the star's, and every message where nothing runs compiled): one call
  checks its links and takes the transport's lock once for all its rounds.

The node is an explicit input (``Node``: ranks on one node and the cores they share); the default,
``node=None``, gives every rank a core of its own (and the cache to itself), which is what the 8-1,024-rank
cluster predictions assume.

``work`` (``gradcoll.model.work``) gives, for one algorithm, world size and buffer size ``S``, the messages, link bytes, reduced bytes
and copied bytes on the critical path, and the mean copied and reduced bytes of the other ranks:

The message size per algorithm (for the per-core cache) is ``S/n`` for the ring and ``S`` for the star and
recursive doubling (``Work.message``); halving-doubling on 4 ranks or more weighs each round's own message as
it halves and doubles back (``halving_out_of_l2``), a compiled round's in pieces of at most ``piece_bytes``.

* ``ring``: ``2 (n-1)`` steps of ``S/n`` bytes, ``n-1`` of them followed by the reduction of ``S/n``; every
  step copies ``S/n`` in and ``S/n`` out. The model treats each step as one message (it ignores the segment
  pipelining of ``gradcoll.algorithms.ring``, which can hide part of the reduction behind the next transfer
  when the link, not the CPU, moves the bytes).
* ``star``: rank 0 receives ``(n-1) S`` through its ingress, adds ``(n-1) S`` and sends ``(n-1) S``; two
  message latencies. Copies on the critical path: the root's ``2 (n-1) S`` plus ``S`` (its own input into the
  reduction rows). The first sender's copy in and the last receiver's copy out are not on it: the transports
  stream a message, and a receiver that is only waiting copies out behind the sender's copy in (see
  ``gradcoll.model.sim``). They still load the node's memory, so the cache term counts them (``streamed``,
  ``2 S``).
* ``halving_doubling``: ``2 log2 p`` exchanges, halving from ``S/2`` to ``S/p`` bytes and doubling back: the
  ring's ``2 (p-1)/p S`` link bytes, ``(p-1)/p S`` reduced and ``4 (p-1)/p S`` copied, in the rounds of
  recursive doubling (message ``S/2``, the first round's); when ``n`` is not a power of two, recursive
  doubling's fold and unfold more.
* ``recursive_doubling``: ``log2 p`` exchanges of ``S`` bytes (``S`` copied in and ``S`` out: both ends copy
  their own message in, then the other's out), each followed by the reduction of ``S`` (``p`` the largest
  power of two <= n); when ``n`` is not a power of two, a fold (``S`` bytes, reduced) and an unfold (``S``)
  more, each copied once on the critical path (the receiving end waits idle and streams; ``streamed``
  ``2 S``).

``predict`` adds ``alpha m + switch m x + beta b + cpu``, where ``cpu`` is the critical rank's CPU work
``gamma r + delta k`` (plus the node's cache term, on ``r + k`` and the streamed copies, and the per-core one,
on ``r + k``) plus ``wait_share x min(that, wait_busy_s)``, or, when the node's ranks outnumber its cores, the
node's CPU work shared by its cores if that is more (``x = max(0, ranks / cores - 1)``).

``fit`` estimates the parameters from ``gradcoll bench --json`` rows of several algorithms and sizes by least
squares (relative residuals, so small and large sizes weigh alike; a parameter that comes out negative is
dropped and the rest refitted; parameters can be held fixed). ``crossovers`` lists the sizes where the fastest
algorithm changes; ``stored_models`` reads the models fitted to this project's measurements
(``costmodel_fitted.json``, written by ``benches/fit_costmodel.py``), from which ``algorithm="auto"`` takes
its thresholds. On the simulated network of ``gradcoll.model.sim``, ``gradcoll.algorithms.simulate`` runs the
real algorithm code against the same model (one core per rank, so without ``switch``, the shared CPU and
``wait_share``); its virtual times equal these closed forms.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..errors import UsageError
from .work import ALGORITHMS, DIRECT_MODES, L2_COPIES, Work, halving_out_of_l2, out_of_l2, terms, work

__all__ = ["AlphaBeta", "Node", "Work", "ALGORITHMS", "DIRECT_MODES", "PARAMETERS", "terms", "work", "predict", "best",
           "fit", "crossovers", "busbw", "link_model", "stored_models", "FITTED_PATH", "EARLIER_TIME_KEYS", "out_of_l2",
           "L2_COPIES"]

#: The linear parameters ``fit`` can estimate, in this order.
PARAMETERS = ("alpha_s", "switch_s", "beta_s_per_byte", "gamma_s_per_byte", "delta_s_per_byte", "mem_s_per_byte",
              "l2_s_per_byte", "wait_share", "round_s", "call_s")

#: The stored models fitted to this project's measurements (``benches/fit_costmodel.py --write``).
FITTED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fitted.json")


@dataclass(frozen=True)
class AlphaBeta:
    """Per-message latency, seconds per link byte, per reduced byte, per copied byte; oversubscription and cache terms."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    delta_s_per_byte: float = 0.0
    switch_s: float = 0.0
    mem_s_per_byte: float = 0.0
    cache_bytes: float = 0.0
    l2_s_per_byte: float = 0.0
    l2_bytes: float = 0.0
    wait_share: float = 0.0
    wait_busy_s: float = 0.0
    piece_bytes: float = 0.0
    round_s: float = 0.0
    call_s: float = 0.0

    def describe(self) -> str:
        """``alpha 12.3 us, beta 1.05 GB/s, gamma 4.2 GB/s`` (bandwidths as 1/beta, ...), then the optional terms."""
        def bw(x: float) -> str:
            return "inf" if x <= 0 else f"{1 / x / 1e9:.3g} GB/s"
        out = f"alpha {self.alpha_s * 1e6:.3g} us, beta {bw(self.beta_s_per_byte)}, gamma {bw(self.gamma_s_per_byte)}"
        if self.delta_s_per_byte:
            out += f", delta {bw(self.delta_s_per_byte)}"
        if self.switch_s:
            out += f", switch {self.switch_s * 1e6:.3g} us"
        if self.mem_s_per_byte:
            out += f", mem {self.mem_s_per_byte * 1e12:.3g} ps/B beyond {self.cache_bytes / (1 << 20):.3g} MiB"
        if self.l2_s_per_byte:
            out += f", l2 {self.l2_s_per_byte * 1e12:.3g} ps/B beyond {self.l2_bytes / (1 << 20):.3g} MiB per core"
        if self.wait_share:
            out += f", wait share {self.wait_share:.2g} of the first {self.wait_busy_s * 1e6:.3g} us"
        if self.piece_bytes:
            out += f", recursive doubling in {self.piece_bytes / 1024:.3g} KiB pieces"
        if self.round_s:
            out += f", {self.round_s * 1e6:.3g} us a compiled round"
        if self.call_s:
            out += f", {self.call_s * 1e6:.3g} us a compiled call"
        return out


@dataclass(frozen=True)
class Node:
    """``ranks`` ranks of the world run on one node and share its ``cores`` cores (and its cache)."""

    ranks: int
    cores: float

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.cores <= 0:
            raise UsageError(f"a node needs ranks >= 1 and cores > 0, got {self.ranks} ranks, {self.cores} cores")


def link_model(gbit_per_s: float, alpha_s: float, reduce_bytes_per_s: float) -> AlphaBeta:
    """A model for a network link of ``gbit_per_s`` with latency ``alpha_s`` and a kernel of given throughput."""
    return AlphaBeta(alpha_s, 8.0 / (gbit_per_s * 1e9), 1.0 / reduce_bytes_per_s)


def _columns(algorithm: str, n: int, nbytes: float, node: Node | None, model: AlphaBeta | None) -> np.ndarray:
    """The coefficients of ``PARAMETERS`` in the predicted time (the CPU branch chosen with ``model``)."""
    w = work(algorithm, n, nbytes)
    planned = _planned(algorithm, n, model)
    if planned and model is not None and model.piece_bytes < w.message:
        w = w._replace(message=model.piece_bytes)  # the transport's step reduces each piece while it is in cache
    ranks, cores = (1, 1.0) if node is None else (min(node.ranks, n), node.cores)
    cache = 0.0 if model is None else model.cache_bytes
    out_of_cache = max(0.0, 1.0 - cache / (float(nbytes) * ranks)) if nbytes > 0 else 0.0
    l2_bytes = 0.0 if model is None else model.l2_bytes
    if algorithm == "halving_doubling" and n >= 4:  # at 2 (and 3) ranks the ring's messages
        # every round's own message (as it halves and doubles back), a compiled round's in pieces
        l2 = halving_out_of_l2(n, float(nbytes), l2_bytes, ranks / cores, model.piece_bytes if planned and model else 0.0)
    else:
        l2 = out_of_l2(w.message, l2_bytes, ranks / cores)
    # The streamed copies run on another core but through the same memory: the cache term counts them (the
    # per-core l2 term, like delta, not: that core's time is hidden).
    crit = np.array([w.reduced, w.copied, out_of_cache * (w.reduced + w.copied + w.streamed), l2 * (w.reduced + w.copied)])
    red = w.reduced + (ranks - 1) * w.other_reduced
    cp = w.copied + (ranks - 1) * w.other_copied
    shared = np.array([red, cp, out_of_cache * (red + cp), l2 * (red + cp)]) / cores
    cpu = crit
    x = max(0.0, ranks / cores - 1.0)
    waiting = 0.0
    if ranks > cores and model is not None:
        g = np.array([model.gamma_s_per_byte, model.delta_s_per_byte, model.mem_s_per_byte, model.l2_s_per_byte])
        if float(shared @ g) > float(crit @ g):
            cpu = shared
        else:
            # The critical rank works while others wait for it; a waiting rank stays runnable (polls or
            # yields) for the transport's first wait_busy_s, and takes a share of the cores meanwhile.
            waiting = x * min(float(crit @ g), model.wait_busy_s)
    # Where the transport runs the rounds as compiled steps (piece_bytes), recursive doubling and halving-doubling
    # (in a power-of-two group) and the ring (in any) run all their rounds in one call: its fixed cost (call_s,
    # in place of the messages' alpha) and the wake-up of a descheduled peer count once, and each round, whose
    # waits poll and yield instead of sleeping, costs round_s, times the ranks sharing a core.
    if planned:
        # A ring's round needs every rank running (each waits on its left neighbour), so with more ranks than
        # cores each round wakes a descheduled one; a pairwise round (recursive doubling, halving-doubling)
        # needs only its two, and the wake-up counts once per call.
        wakes = x * (w.messages if algorithm == "ring" else 1.0)
        return np.array([0.0, wakes, w.link_bytes, *cpu, waiting, w.messages * (1.0 + x), 1.0])
    return np.array([w.messages, w.messages * x, w.link_bytes, *cpu, waiting, 0.0, 0.0])


#: The algorithms a transport with compiled steps (``AlphaBeta.piece_bytes``) runs as one call of all their rounds:
#: the ring in any group, the others in a power-of-two group.
_PLANNED = ("recursive_doubling", "halving_doubling", "ring")


def _planned(algorithm: str, n: int, model: AlphaBeta | None) -> bool:
    """Whether ``model``'s transport runs ``algorithm`` on ``n`` ranks as one compiled call of all its rounds."""
    return algorithm in _PLANNED and model is not None and model.piece_bytes > 0 and n > 1 and (
        algorithm == "ring" or not n & (n - 1))


def _vector(model: AlphaBeta) -> np.ndarray:
    return np.array([getattr(model, f) for f in PARAMETERS])


def predict(algorithm: str, n: int, nbytes: float, model: AlphaBeta, *, node: Node | None = None) -> float:
    """Predicted seconds for one allreduce of ``nbytes`` on ``n`` ranks (``node``: None = a core per rank)."""
    return float(_columns(algorithm, n, nbytes, node, model) @ _vector(model))


def busbw(nbytes: float, n: int, seconds: float) -> float:
    """nccl-tests bus bandwidth in bytes/s: ``S / t * 2 (n-1) / n``."""
    return nbytes / seconds * (2 * (n - 1) / n if n > 1 else 1.0)


def best(n: int, nbytes: float, model: AlphaBeta, algorithms: Sequence[str] = ALGORITHMS, *,
         node: Node | None = None) -> str:
    """The algorithm with the lowest predicted time (first listed wins ties)."""
    return min(algorithms, key=lambda a: predict(a, n, nbytes, model, node=node))


def _row_node(row: Mapping[str, Any]) -> Node | None:
    cores = row.get("cores")
    return None if cores is None else Node(int(row["ranks"]), float(cores))


#: Time fields of ``gradcoll bench --json`` rows under the names files written before them use (``load_rows`` of
#: ``gradcoll.cli.bench`` renames them; ``fit`` also reads rows built by hand under the earlier names).
EARLIER_TIME_KEYS = {"iter_mean_us_avg_over_ranks": "time_avg_us", "iter_mean_us_min_over_ranks": "time_min_us",
                     "iter_mean_us_max_over_ranks": "time_max_us", "iter_median_us_avg_over_ranks": "time_med_us"}


def fit(rows: Iterable[Mapping[str, Any]], *, time_key: str = "iter_mean_us_avg_over_ranks",
        params: Sequence[str] = ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte"),
        fixed: Mapping[str, float] | None = None, cache_bytes: float = 0.0, l2_bytes: float = 0.0,
        wait_busy_s: float = 0.0, piece_bytes: float = 0.0) -> AlphaBeta:
    """Least-squares fit of the ``params`` (of ``PARAMETERS``) to ``gradcoll bench --json`` rows.

    Each row needs ``algorithm`` (one of ``ALGORITHMS``), ``ranks``,
    ``size`` and ``time_key`` (microseconds; by default each rank's mean time
    per call averaged over the ranks, read under its earlier name
    ``time_avg_us`` where a row has only that); a row with ``cores`` was
    measured with all its ranks on one node of that many cores. Residuals are
    relative to the measured time. ``fixed`` holds parameters at given values
    (e.g. ``gamma_s_per_byte`` from a kernel benchmark); the rest are zero.
    ``cache_bytes`` is not fitted (it enters non-linearly): try several.
    ``piece_bytes`` (the transport's recursive-doubling piece) is not fitted either.
    Rows of at least two algorithms (or two world sizes) are needed to tell
    the per-byte terms apart.
    """
    fixed = dict(fixed or {})
    for name in (*params, *fixed):
        if name not in PARAMETERS:
            raise UsageError(f"unknown parameter {name!r}; fit knows {', '.join(PARAMETERS)}")
    data: list[tuple[str, int, float, Node | None]] = []
    t_rows: list[float] = []
    for row in rows:
        algo = str(row["algorithm"])
        if algo not in ALGORITHMS + DIRECT_MODES:
            raise UsageError(f"row has algorithm {algo!r}; fit needs rows of {', '.join(ALGORITHMS + DIRECT_MODES)}")
        data.append((algo, int(row["ranks"]), float(row["size"]), _row_node(row)))
        key = time_key if time_key in row else EARLIER_TIME_KEYS.get(time_key, time_key)
        t_rows.append(float(row[key]) * 1e-6)
    if len(t_rows) < 3:
        raise UsageError(f"fit needs at least 3 rows, got {len(t_rows)}")
    t = np.asarray(t_rows)
    free = [PARAMETERS.index(p) for p in params if p not in fixed]
    held = np.zeros(len(PARAMETERS))
    for name, value in fixed.items():
        held[PARAMETERS.index(name)] = value
    coef = held.copy()
    coef[free] = 1e-9  # any positive start: only picks the first CPU branch of oversubscribed rows
    for _ in range(20):  # the CPU branch of oversubscribed rows depends on the parameters: iterate to a fixed point
        model = _from_vector(coef, cache_bytes, l2_bytes, wait_busy_s, piece_bytes)
        a = np.array([_columns(al, n, s, nd, model) for al, n, s, nd in data])
        y = (t - a @ held) / t  # relative residuals
        a = a / t[:, None]
        active = list(free)
        new = held.copy()
        while active:
            sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
            if (sol >= 0).all():
                new[active] = sol
                break
            active.pop(int(np.argmin(sol)))  # the most negative parameter goes to zero
        if np.allclose(new, coef, rtol=1e-9, atol=0.0):
            break
        coef = new
    return _from_vector(coef, cache_bytes, l2_bytes, wait_busy_s, piece_bytes)


def _from_vector(coef: np.ndarray, cache_bytes: float, l2_bytes: float = 0.0, wait_busy_s: float = 0.0,
                 piece_bytes: float = 0.0) -> AlphaBeta:
    values = {name: float(v) for name, v in zip(PARAMETERS, coef, strict=True)}
    return AlphaBeta(**values, cache_bytes=float(cache_bytes), l2_bytes=float(l2_bytes), wait_busy_s=float(wait_busy_s),
                     piece_bytes=float(piece_bytes))


def crossovers(model: AlphaBeta, n: int, *, lo: int = 1 << 10, hi: int = 1 << 30,
               algorithms: Sequence[str] = ALGORITHMS, node: Node | None = None) -> list[tuple[int, str, str]]:
    """``(nbytes, before, after)`` for every size in ``[lo, hi]`` where the fastest algorithm changes.

    The size is the smallest multiple of 4 bytes (one float32) at which ``after`` wins.
    """
    out: list[tuple[int, str, str]] = []
    steps = 64 * max(1, int(math.log2(hi / lo)))
    grid = sorted({int(round(lo * (hi / lo) ** (i / steps))) // 4 * 4 for i in range(steps + 1)})
    prev = best(n, grid[0], model, algorithms, node=node)
    for a, b in zip(grid, grid[1:], strict=False):
        cur = best(n, b, model, algorithms, node=node)
        if cur != prev:
            left, right = a, b  # best(left) == prev, best(right) == cur
            while right - left > 4:
                mid = (left + right) // 8 * 4
                if best(n, mid, model, algorithms, node=node) == prev:
                    left = mid
                else:
                    right = mid
            out.append((right, prev, best(n, right, model, algorithms, node=node)))
            prev = cur
    return out


@functools.cache
def stored_models(path: str = FITTED_PATH) -> dict[str, tuple[AlphaBeta, float | None, int]]:
    """The fitted models by transport: (model, cores of the node measured on or None, the largest world measured)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as exc:
        raise UsageError(f"no stored cost models at {path} (run benches/fit_costmodel.py --write): {exc}") from exc
    names = {f.name for f in fields(AlphaBeta)}
    out: dict[str, tuple[AlphaBeta, float | None, int]] = {}
    for name, entry in raw["transports"].items():
        model = AlphaBeta(**{k: float(v) for k, v in entry["model"].items() if k in names})
        cores = entry.get("cores")
        out[name] = (model, None if cores is None else float(cores), int(entry["max_ranks"]))
    return out

