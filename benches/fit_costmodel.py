"""Fit the cost model (gradcoll.costmodel) to ``gradcoll bench`` rows, check it, and store it for ``auto``.

Usage::

    python benches/fit_costmodel.py                      # the stored runs in benches/results/costmodel/
    python benches/fit_costmodel.py --run --ranks 2 4    # measure first (tcp and shm, every algorithm)
    python benches/fit_costmodel.py --run --iters 100 --repeat 3   # each row the median of 3 runs
    python benches/fit_costmodel.py --write              # also store the models algorithm="auto" uses
    python benches/fit_costmodel.py --run --transports shm --sizes 4K 1M --write --store window
    python benches/fit_costmodel.py a.json b.json        # given ``gradcoll bench --json`` files

On shm, ``--run`` also times the direct allreduce's two schedules (each
forced with ``GRADCOLL_DIRECT_MODE``), from which it fits the *window* model:
where the direct allreduce turns from one-shot to two-shot
(``gradcoll.model.window_model``). ``--write`` replaces the stored models of
this run (``--store`` names which) and keeps the others.

For every transport it fits one model to all rows (every algorithm, every
world size; ``--fit-ranks 2`` fits on the 2-rank rows only), prints it and
the % error of the prediction for each measured row. Loopback transports
(tcp and shm on one host) have no link, so ``beta`` is held at zero and
``alpha``, ``switch``, ``gamma``, ``delta``, ``mem``, ``l2`` and
``wait_share`` are fitted, the node's cache size by trying powers of two.
Three sizes are not fitted but read: the per-core cache ``l2_bytes`` (level 2,
from sysfs when ``--run`` measures, stored in every row),
``wait_busy_s``, how long a waiting rank of the transport stays runnable
(shm's yield window, tcp's busy poll: the transports' constants), and
``piece_bytes``, the piece tcp's compiled recursive-doubling step reduces
in cache (``gradcoll.transport.tcp_fast.PIECE_BYTES``); and ``round_s``, a
compiled round's cost, read from the 2-rank rows up to 16 KiB
(``round_cost``: halving-doubling's two rounds less recursive doubling's one). ``gamma`` is the reduction kernel's
cost, the same whatever transport carries the bytes: with rows of several
transports it is one value for all of them, the one (on a grid) with the
lowest mean error over all their rows. Each row says the node it ran on
(``cores``: all ranks on one host of that many cores), which is how the model
knows that 4 ranks on 2 cores share them. ``--min-size`` (default 64K) is
the smallest size the error target (25%) applies to and the fit uses.
``--run`` times the four algorithms taking turns in one launch per
transport and world size (``gradcoll bench --algorithm ring,star,...``),
and starts each rank with ``NUMBA_NUM_THREADS`` = cores / ranks (at
least 1), so that a rank's threaded reduction kernel does not take the cores
of the other ranks (the model gives each rank its share of the node), and
``--iters`` iterations per size (errors are on the median iteration,
``iter_median_us_avg_over_ranks``, where the rows have it; ``time_med_us`` in
files written before that name); ``--repeat`` runs every bench
that many times and keeps, per row, the median of the runs. ``--write`` stores the models in
``gradcoll/model/fitted.json``, from which ``select_allreduce`` derives
its thresholds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from gradcoll.cli.bench import load_rows, parse_size
from gradcoll.model.costmodel import ALGORITHMS, DIRECT_MODES, FITTED_PATH, AlphaBeta, Node, fit, predict
from gradcoll.model.window_model import WINDOW_MODEL, measured_crossovers

HERE = os.path.dirname(os.path.abspath(__file__))
STORED = os.path.join(HERE, "results", "costmodel")
#: Parameters fitted for loopback transports (no link: beta stays 0).
LOOPBACK = ("alpha_s", "switch_s", "gamma_s_per_byte", "delta_s_per_byte", "mem_s_per_byte", "l2_s_per_byte", "wait_share",
            "round_s", "call_s")
CACHES = [float(1 << k) for k in range(19, 27)]  # 512 KiB .. 64 MiB
#: The fields of a ``gradcoll bench`` row fitted: the median iteration, else the mean one (each averaged over the ranks).
MEDIAN, MEAN = "iter_median_us_avg_over_ranks", "iter_mean_us_avg_over_ranks"


def measure(out_dir: str, ranks: list[int], transports: list[str], lo: str, hi: str, iters: int = 30,
            warmup: int = 3, repeat: int = 1) -> list[str]:
    """Run ``gradcoll bench`` for every world size, transport and algorithm; the JSON files written.

    The algorithms take turns in one launch per world size and transport
    (``gradcoll bench --algorithm ring,star,...``): separate launches differ
    by up to a third where ranks outnumber cores, and their rows put the
    crossovers where the same processes do not. The direct allreduce's two
    schedules (shm) take a launch each, forced by the environment.
    With ``repeat`` > 1 every bench runs that many times (interleaved: all
    launches once, then again) and each row keeps the median over the runs
    of ``iter_median_us_avg_over_ranks`` and ``iter_mean_us_avg_over_ranks``, with
    the runs' medians in ``runs_iter_median_us_avg_over_ranks``: 4 ranks on 2 cores differ from one run to the next
    by up to a third at 64 KiB-2 MiB, whatever the iterations per run.
    """
    os.makedirs(out_dir, exist_ok=True)
    cores = os.cpu_count() or 1
    l2 = l2_per_core()
    paths = []
    for n in ranks:
        threads = max(1, cores // n)
        env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
        for be in transports:
            # (row labels, --algorithm, environment): the algorithms taking turns in one launch; on shm, also the
            # direct allreduce's two schedules, each forced
            jobs = [(list(ALGORITHMS), ",".join(ALGORITHMS), {})]
            if be == "shm":
                jobs += [([m], "direct", {"GRADCOLL_DIRECT_MODE": m[len("direct_"):].replace("_", "-")})
                         for m in DIRECT_MODES]
            runs: dict[str, list[list[dict[str, Any]]]] = {label: [] for labels, _, _ in jobs for label in labels}
            for _ in range(repeat):
                for labels, algo, extra in jobs:
                    path = os.path.join(out_dir, f"{be}_{labels[0] if len(labels) == 1 else 'turns'}_{n}.json")
                    subprocess.run(env=dict(env, **extra), check=True, stdout=subprocess.DEVNULL, args=[
                        sys.executable, "-m", "gradcoll", "bench", "-n", str(n), "--backend", be, "--algorithm", algo,
                        "--min-size", lo, "--max-size", hi, "--iters", str(iters), "--warmup", str(warmup),
                        "--json", path])
                    got = load_rows(path)
                    if len(labels) == 1:
                        for r in got:
                            r["algorithm"] = labels[0]  # "direct" ran, in the schedule named by the label
                    else:
                        os.remove(path)  # (split by algorithm below)
                    for label in labels:
                        runs[label].append([r for r in got if r["algorithm_requested"] == label])
            for algo, got in runs.items():
                rows = []
                for same in zip(*got, strict=True):
                    r = dict(same[0])
                    r["cores"], r["numba_threads"] = cores, threads  # where it ran: every rank on this host
                    r["l2_bytes"] = l2  # its per-core cache
                    if repeat > 1:
                        r["runs_iter_median_us_avg_over_ranks"] = [x[MEDIAN] for x in same]
                        for k in (MEDIAN, MEAN):
                            r[k] = statistics.median(x[k] for x in same)
                    rows.append(r)
                path = os.path.join(out_dir, f"{be}_{algo}_{n}.json")
                with open(path, "w") as f:
                    json.dump(rows, f, indent=1)
                paths.append(path)
    return paths


def l2_per_core() -> float:
    """This machine's per-core (level 2) cache in bytes, from sysfs; 0 where it cannot be read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    for idx in sorted(glob.glob(os.path.join(base, "index*"))):
        try:
            with open(os.path.join(idx, "level")) as f:
                level = int(f.read())
            with open(os.path.join(idx, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if level == 2:
            return float(parse_size(size.rstrip("B")))
    return 0.0


def l2_of(rows: list[dict[str, Any]]) -> float:
    """The per-core cache the rows were measured with (``l2_bytes``, recorded by ``--run``), else this machine's."""
    got = {r["l2_bytes"] for r in rows if "l2_bytes" in r}
    return float(got.pop()) if len(got) == 1 else l2_per_core()


def wait_busy(rows: list[dict[str, Any]]) -> float:
    """How long a waiting rank of the rows' transport stays runnable before it sleeps (the transport's constants).

    shm on a node with more ranks than cores does not spin but yields the CPU
    (``sched_yield``) for its first ``_YIELD_S``; tcp busy-polls ``SPIN_S``
    and then sleeps in ``poll()``.
    """
    from gradcoll.transport import shm, tcp

    names = {r["transport"] for r in rows}
    if names == {"shm"}:
        return float(shm._YIELD_S)
    if names == {"tcp"}:
        return float(tcp.SPIN_S)
    return 0.0


def piece(rows: list[dict[str, Any]]) -> float:
    """The piece a recursive-doubling round of the rows' transport reduces in cache (tcp's compiled step), else 0."""
    from gradcoll.transport import tcp, tcp_fast

    return float(tcp_fast.PIECE_BYTES) if {r["transport"] for r in rows} == {"tcp"} and tcp._IO is not None else 0.0


def round_cost(rows: list[dict[str, Any]], key: str) -> float | None:
    """The cost (s) of one round of a compiled call (``AlphaBeta.round_s``), read from the rows, not fitted: on 2
    ranks up to 16 KiB, halving-doubling's call (2 rounds) less recursive doubling's (1 round), the median over
    those sizes; None where the rows do not have both (or the transport has no compiled rounds).

    The fit cannot find it: from 64 KiB, where the error target applies, the rounds' bytes hide it, and below it
    the per-message cost of the ring and the star weighs more. Yet it decides where ``auto`` turns from
    recursive doubling to halving-doubling.
    """
    if piece(rows) <= 0:
        return None
    small = [r for r in rows if r["ranks"] == 2 and r["size"] <= 16 << 10]
    by = {(r["algorithm"], r["size"]): r[key] for r in small}
    diffs = [by[("halving_doubling", s)] - by[("recursive_doubling", s)] for a, s in by
             if a == "recursive_doubling" and ("halving_doubling", s) in by]
    return max(0.0, statistics.median(diffs)) * 1e-6 if diffs else None


def time_key(rows: list[dict[str, Any]]) -> str:
    return MEDIAN if all(MEDIAN in r for r in rows) else MEAN


def node_of(r: dict[str, Any]) -> Node | None:
    return Node(r["ranks"], r["cores"]) if "cores" in r else None


def errors(rows: list[dict[str, Any]], model: AlphaBeta, key: str) -> list[tuple[dict[str, Any], float, float]]:
    out = []
    for r in rows:
        pred = predict(r["algorithm"], r["ranks"], r["size"], model, node=node_of(r)) * 1e6
        out.append((r, pred, 100.0 * (pred - r[key]) / r[key]))
    return out


def fit_best(rows: list[dict[str, Any]], key: str, gamma: float | None = None,
             round_s: float | None = None) -> tuple[float, AlphaBeta]:
    """(mean |relative error| %, model) of the fit over the cache sizes in CACHES with the lowest error.

    ``gamma`` (s/B) holds the reduction kernel's cost instead of fitting it; ``round_s`` a compiled round's.
    """
    best: tuple[float, AlphaBeta] | None = None
    fixed = {k: v for k, v in (("gamma_s_per_byte", gamma), ("round_s", round_s)) if v is not None}
    params = tuple(p for p in LOOPBACK if p not in fixed)
    for cache in CACHES:
        m = fit(rows, time_key=key, params=params, fixed=fixed, cache_bytes=cache, l2_bytes=l2_of(rows),
                wait_busy_s=wait_busy(rows), piece_bytes=piece(rows))
        score = sum(abs(e) for _, _, e in errors(rows, m, key)) / len(rows)
        if best is None or score < best[0]:
            best = (score, m)
    assert best is not None
    return best


def shared_gamma(by_transport: dict[str, list[dict[str, Any]]], key: str) -> float:
    """The kernel cost (s/B) that, held for every transport, gives the lowest mean |error| over all their rows.

    The reduction kernel is the same whatever carries the bytes, so one
    ``gamma`` serves every transport (searched on a grid of 1.5-24 GB/s,
    2^(1/4) apart); the other parameters are fitted per transport.
    """
    grid = [1 / (1.5e9 * 2 ** (k / 4)) for k in range(17)]
    total = {g: sum(fit_best(rows, key, g)[0] * len(rows) for rows in by_transport.values()) for g in grid}
    return min(grid, key=lambda g: total[g])


def _selected(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The rows of model ``name``: a transport's message algorithms, or (``WINDOW_MODEL``) the direct schedules."""
    if name == WINDOW_MODEL:
        return [r for r in rows if r["algorithm"] in DIRECT_MODES]
    return [r for r in rows if r["transport"] == name and r["algorithm"] in ALGORITHMS]


def report(rows: list[dict[str, Any]], min_size: int, fit_ranks: list[int] | None, verbose: bool) -> dict[str, Any]:
    """Fit one model per transport (its message algorithms) and, from rows of the direct schedules, the window's.

    The window model is fitted on every size (its crossover, one-shot to two-shot, lies below ``min_size``),
    with the kernel cost the transports share.
    """
    result: dict[str, Any] = {}
    key = time_key(rows)
    names = sorted({r["transport"] for r in rows if r["algorithm"] in ALGORITHMS})
    fitted = {tr: [r for r in _selected(rows, tr) if r["size"] >= min_size
                   and (fit_ranks is None or r["ranks"] in fit_ranks)] for tr in names}
    gamma = shared_gamma(fitted, key) if len(fitted) > 1 else None
    if gamma is not None:
        print(f"gamma (the reduction kernel, one for every transport): {1 / gamma / 1e9:.3g} GB/s")
    window = [r for r in _selected(rows, WINDOW_MODEL) if fit_ranks is None or r["ranks"] in fit_ranks]
    if window:
        fitted[WINDOW_MODEL] = window
    for tr in fitted:
        sel = _selected(rows, tr)
        floor = 0 if tr == WINDOW_MODEL else min_size
        model = fit_best(fitted[tr], key, gamma, None if tr == WINDOW_MODEL else round_cost(sel, key))[1]
        print(f"\n## {tr}: {model.describe()}\n(fitted on {key} of rows >= {min_size} B, ranks {fit_ranks or 'all'})")
        errs = errors(sel, model, key)
        if verbose:
            print(f"{'ranks':>5} {'algorithm':>18} {'size':>10} {'measured us':>12} {'model us':>10} {'err %':>7}")
            for r, pred, e in errs:
                flag = "" if r["size"] < floor or abs(e) <= 25 else "  <-- over 25%"
                print(f"{r['ranks']:>5} {r['algorithm']:>18} {r['size']:>10} {r[key]:>12.1f} {pred:>10.1f} "
                      f"{e:>+7.1f}{flag}")
        cores = {r.get("cores") for r in sel}
        entry: dict[str, Any] = {"model": asdict(model), "cores": cores.pop() if len(cores) == 1 else None,
                                 "max_ranks": max(r["ranks"] for r in sel), "time_key": key,
                                 "fit_ranks": fit_ranks or sorted({r["ranks"] for r in sel}), "min_size": floor}
        for n in sorted({r["ranks"] for r in sel}):
            big = [(r, abs(e)) for r, _, e in errs if r["size"] >= floor and r["ranks"] == n]
            ok = sum(e <= 25 for _, e in big)
            worst = sorted(big, key=lambda x: -x[1])[:3]
            print(f"{n} ranks, from {floor} B: max |error| {max(e for _, e in big):.1f}%, "
                  f"mean {sum(e for _, e in big) / len(big):.1f}%, {ok}/{len(big)} rows within 25%; worst: "
                  + ", ".join(f"{r['algorithm']} {r['size']} B {e:.0f}%" for r, e in worst))
            entry[f"ranks_{n}"] = {"max_abs_err_pct": round(max(e for _, e in big), 1),
                                   "mean_abs_err_pct": round(sum(e for _, e in big) / len(big), 1),
                                   "within_25": ok, "rows": len(big)}
        if tr == WINDOW_MODEL:  # the crossover as measured decides (gradcoll.model.window_model)
            entry["one_shot_bytes"] = measured_crossovers(sel, key)
            print(f"one-shot up to (bytes, by world size): {entry['one_shot_bytes']}")
        result[tr] = entry
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="gradcoll bench --json files (default: the stored runs)")
    ap.add_argument("--run", action="store_true", help="run gradcoll bench first")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"])
    ap.add_argument("--sizes", nargs=2, default=["4K", "32M"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1, help="run every bench this many times; rows keep the median")
    ap.add_argument("--out", default=STORED, help="where --run writes its JSON files")
    ap.add_argument("--min-size", default="64K")
    ap.add_argument("--fit-ranks", type=int, nargs="+", default=None, help="fit only on these world sizes")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every row's error")
    ap.add_argument("--json", dest="json_path", default=None, help="write the fitted models and errors here")
    ap.add_argument("--write", action="store_true", help=f"store the models for algorithm='auto' ({FITTED_PATH})")
    ap.add_argument("--store", nargs="+", default=None, metavar="MODEL",
                    help=f"with --write, store only these of the run's models (transport names, {WINDOW_MODEL!r})")
    a = ap.parse_args()
    paths = measure(a.out, a.ranks, a.transports, *a.sizes, iters=a.iters, warmup=a.warmup,
                    repeat=a.repeat) if a.run else (
        a.files or sorted(glob.glob(os.path.join(STORED, "*.json"))))
    rows: list[dict[str, Any]] = []
    for p in paths:
        rows.extend(load_rows(p))  # files written before the current field names too
    res = report(rows, parse_size(a.min_size), a.fit_ranks, a.verbose)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(res, f, indent=1)
    if a.write:  # the models of this run replace theirs; the others, and the other entries, stay as stored
        try:
            with open(FITTED_PATH) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        stored = doc.get("transports", {})
        with open(FITTED_PATH, "w") as f:
            new = {k: v for k, v in res.items() if a.store is None or k in a.store}
            json.dump({**doc, "generated_by": "python benches/fit_costmodel.py --write",
                       "transports": {**stored, **new}}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
