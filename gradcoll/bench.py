"""``gradcoll bench``: an nccl-tests-style allreduce table over local ranks.

The driver launches N ranks ([`gradcoll.launch.launch`][gradcoll.launch.launch]); each rank
sweeps the sizes, times ``iters`` allreduces after ``warmup`` ones, checks
the result against the exact expected mean (#wrong) and reports one JSON line
per size. The driver renders a progress bar and the table: size, count,
dtype, algorithm, transport, time avg/min/max across ranks (of each rank's
mean over the timed iterations), algbw and busbw (busbw = algbw x 2(n-1)/n,
as nccl-tests define it), #wrong. ``--json`` keeps
the rows, which also carry ``time_med_us``: the median of a rank's
per-iteration times, averaged across ranks (robust to a few iterations
slowed by other load on the machine); ``--plot`` draws busbw against size
(needs matplotlib).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["build_parser", "run_from_args", "worker_main", "parse_size", "sizes_between"]

_TAG = "@@gradcoll-bench "


def parse_size(text: str) -> int:
    """'4K', '64M', '1G' or a plain byte count -> bytes."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def sizes_between(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` bytes inclusive."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def _expected(rank_values: np.ndarray, world: int) -> np.ndarray:
    from .kernels import mean_reduce

    expected: np.ndarray = mean_reduce([rank_values * np.float32(r + 1) for r in range(world)])  # host inputs give a host array
    return expected


def worker_main(argv: Sequence[str] | None = None) -> int:
    """One rank of the benchmark."""
    import gradcoll

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs=2, default=["4K", "64M"])
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--wire-dtype", default=None)
    a = ap.parse_args(argv)
    kw: dict[str, Any] = {"algorithm": a.algorithm}
    if a.deterministic:
        kw["deterministic"] = True
    if a.wire_dtype:
        kw["wire_dtype"] = a.wire_dtype
    group = gradcoll.init_process_group(os.environ.get("GRADCOLL_BACKEND", "tcp"), "env://", timeout=120.0)
    rank, world = group.rank, group.size
    transport = getattr(getattr(group, "transport", None), "name", "?")
    for nbytes in sizes_between(parse_size(a.sizes[0]), parse_size(a.sizes[1])):
        count = nbytes // 4
        base = (np.arange(count) % 13).astype(np.float32)
        buf = base * np.float32(rank + 1)
        group.allreduce(buf, op="mean", **kw)  # also the first warm-up
        for _ in range(a.warmup - 1):
            group.allreduce(buf, op="mean", **kw)
        group.barrier()
        laps = np.empty(a.iters)
        t0 = t1 = time.perf_counter()
        for i in range(a.iters):
            # Means of identical small-integer-derived values are exact: buf stays put.
            group.allreduce(buf, op="mean", **kw)
            t2 = time.perf_counter()
            laps[i], t1 = t2 - t1, t2
        dt = (t1 - t0) / a.iters
        wrong = int(np.count_nonzero(buf != _expected(base, world)))
        stats = group.allgather(np.array([dt, wrong, np.median(laps)], np.float64))
        if rank == 0:
            row = {
                "size": nbytes,
                "count": count,
                "dtype": "float32",
                "algorithm": a.algorithm,
                "mode": "deterministic" if a.deterministic else f"{a.wire_dtype} wire" if a.wire_dtype else "plain",
                "transport": transport,
                "ranks": world,
                "time_avg_us": float(stats[:, 0].mean() * 1e6),
                "time_min_us": float(stats[:, 0].min() * 1e6),
                "time_max_us": float(stats[:, 0].max() * 1e6),
                "time_med_us": float(stats[:, 2].mean() * 1e6),
                "wrong": int(stats[:, 1].sum()),
            }
            t = row["time_max_us"] * 1e-6
            row["algbw_GBps"] = nbytes / t / 1e9
            row["busbw_GBps"] = row["algbw_GBps"] * (2 * (world - 1) / world if world > 1 else 1.0)
            print(_TAG + json.dumps(row), flush=True)
    group.close()
    return 0


class _Collector(io.TextIOBase):
    """Receives the ranks' output lines: rows go to the table, the rest is echoed."""

    def __init__(self, total: int, show_bar: bool) -> None:
        self.rows: list[dict[str, Any]] = []
        self.total = total
        self.show_bar = show_bar
        self._buf = ""

    def write(self, s: str) -> int:
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if _TAG in line:
                row = json.loads(line.split(_TAG, 1)[1])
                self.rows.append(row)
                self._clear_bar()
                print(format_row(row), flush=True)
                self._bar()
            elif line.strip():
                self._clear_bar()
                print(line, file=sys.stderr, flush=True)
                self._bar()
        return len(s)

    def _bar(self) -> None:
        if self.show_bar:
            k = len(self.rows)
            filled = int(30 * k / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {k}/{self.total} sizes")
            sys.stderr.flush()

    def _clear_bar(self) -> None:
        if self.show_bar:
            sys.stderr.write("\r" + " " * 60 + "\r")


HEADER = (
    f"{'size(B)':>12} {'count':>11} {'type':>7} {'algo':>9} {'transport':>9}"
    f" {'avg(us)':>10} {'min(us)':>10} {'max(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
)


def format_row(r: dict[str, Any]) -> str:
    """One table line."""
    return (
        f"{r['size']:>12} {r['count']:>11} {r['dtype']:>7} {r['algorithm']:>9} {r['transport']:>9}"
        f" {r['time_avg_us']:>10.1f} {r['time_min_us']:>10.1f} {r['time_max_us']:>10.1f}"
        f" {r['algbw_GBps']:>7.2f} {r['busbw_GBps']:>7.2f} {r['wrong']:>6}"
    )


def build_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    """The ``bench`` argument parser."""
    description = "Allreduce bandwidth/latency sweep over local ranks (nccl-tests style)."
    p = sub.add_parser("bench", description=description) if sub is not None else argparse.ArgumentParser(prog="gradcoll bench", description=description)
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--backend", default="shm", choices=["tcp", "shm"])
    p.add_argument("--algorithm", default="auto")
    p.add_argument("--min-size", default="4K")
    p.add_argument("--max-size", default="64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--deterministic", action="store_true", help="time allreduce(deterministic=True)")
    p.add_argument("--wire-dtype", default=None, choices=["bf16", "fp16"], help="time allreduce(wire_dtype=...)")
    p.add_argument("--json", dest="json_path", default=None, help="write the rows to this JSON file")
    p.add_argument("--plot", dest="plot_path", default=None, help="write busbw vs size to this PNG (matplotlib)")
    return p


def run_from_args(a: argparse.Namespace) -> int:
    """Launch the ranks, render the table, write --json/--plot."""
    from .launch import launch

    sizes = sizes_between(parse_size(a.min_size), parse_size(a.max_size))
    mode = " deterministic" if a.deterministic else f" wire {a.wire_dtype}" if a.wire_dtype else ""
    print(f"# gradcoll bench: {a.nprocs} ranks, backend {a.backend}, algorithm {a.algorithm}{mode}, {a.iters} iters")
    print(HEADER)
    col = _Collector(len(sizes), sys.stderr.isatty())
    cmd = [sys.executable, "-m", "gradcoll.bench", "--worker", "--sizes", a.min_size, a.max_size,
           "--algorithm", a.algorithm, "--iters", str(a.iters), "--warmup", str(a.warmup)]
    cmd += ["--deterministic"] if a.deterministic else []
    cmd += ["--wire-dtype", a.wire_dtype] if a.wire_dtype else []
    res = launch(cmd, a.nprocs, backend=a.backend, prefix=False, out=col, timeout=1800)
    col._clear_bar()
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(col.rows, f, indent=1)
    if a.plot_path and col.rows:
        plot(col.rows, a.plot_path)
    if not res.ok:
        print(f"gradcoll bench: rank {res.failed_rank} failed (exit codes {res.returncodes})", file=sys.stderr)
        return 1
    return 0 if all(r["wrong"] == 0 for r in col.rows) else 2


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """busbw against size, one line per (algorithm, transport)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gradcoll bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r["algorithm"], r["transport"]) for r in rows})
    for k in keys:
        sel = [r for r in rows if (r["algorithm"], r["transport"]) == k]
        ax.plot([r["size"] for r in sel], [r["busbw_GBps"] for r in sel], marker="o", label=f"{k[0]} / {k[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(worker_main([x for x in sys.argv[1:] if x != "--worker"]))
    sys.exit(run_from_args(build_parser().parse_args()))
