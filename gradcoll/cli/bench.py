"""``gradcoll bench``: an nccl-tests-style allreduce table over local ranks.

The driver launches N ranks ([`gradcoll.cli.launch.launch`][gradcoll.cli.launch.launch]); each rank
sweeps the sizes, times ``iters`` allreduces after ``warmup`` ones, checks
the result against the exact expected mean (#wrong) and reports one JSON line
per size. The driver renders a progress bar and the table; `--json` keeps the
rows and `--plot` draws busbw against size (`pip install 'gradcoll[plot]'`).
Sizes are bytes, plain (`4096`) or with a binary suffix (`4K`, `1M`, `1G`).

Each rank times every one of the `iters` calls. Two statistics of those
per-call times are taken on each rank (their mean and their median over the
iterations), then one over the ranks; the field names say both, statistic
over the iterations first. The fields of a row (the table's columns in
brackets):

* `size` (`size (B)`), `count` (`count`), `dtype` (`type`): the buffer of
  each rank, float32.
* `algorithm` (`algo`): the allreduce algorithm that ran, as the group
  recorded it (with `--algorithm auto`, the one `auto` picked for this
  size); `algorithm_requested`: the `--algorithm` given.

`--algorithm` takes several algorithms, comma-separated (`ring,halving_doubling`):
they then take turns in the same processes, size by size, in 5 blocks of
calls each after a barrier, one row per algorithm and size. Separate
launches differ by up to a third on a machine with more ranks than cores
(where the kernel places them); turns in one launch compare like with like.
* `mode` (`plain`, `deterministic`, `bf16 wire`, `fp16 wire`), `transport`
  (`transport`), `ranks`, `iters`.
* `iter_mean_us_avg_over_ranks`, `iter_mean_us_min_over_ranks`,
  `iter_mean_us_max_over_ranks` (`time avg/min/max (us)`): each rank's mean
  time per call in microseconds, averaged over, or the least or greatest
  of, the ranks.
* `iter_median_us_avg_over_ranks`: each rank's median time per call,
  averaged over the ranks. Robust to a few calls slowed by other load on the
  machine, so it can be below `iter_mean_us_min_over_ranks`.
* `algbw_GBps` (`algbw (GB/s)`): `size` / `iter_mean_us_max_over_ranks`, in
  1e9 bytes per second; `busbw_GBps` (`busbw (GB/s)`): algbw x 2(n-1)/n, as
  nccl-tests define it.
* `wrong` (`#wrong`): elements that differ from the exact mean, summed over
  the ranks.

Files written before these names (`time_avg_us`, `time_min_us`,
`time_max_us`, `time_med_us`) are read by `load_rows` under the new ones.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms import ALLREDUCE
from ._args import module_main
from ._bench_table import FIELDS, HEADER, format_row, load_rows, parse_size, plot, pyplot, sizes_between

if TYPE_CHECKING:
    from ..group.process_group import ProcessGroup
    from ..observe.trace import CollectiveRecord

__all__ = ["build_parser", "check_args", "run_from_args", "worker_main", "parse_size", "sizes_between", "load_rows",
           "FIELDS", "HEADER", "format_row", "plot"]

_TAG = "@@gradcoll-bench "

def _size_arg(text: str) -> int:
    """An argparse type: a size of at least one float32 and a whole number of them."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n < 4 or n % 4:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: the buffer is float32, so give a positive multiple of 4 bytes")
    return n


def _expected(rank_values: np.ndarray, world: int) -> np.ndarray:
    from ..kernels import mean_reduce

    expected: np.ndarray = mean_reduce([rank_values * np.float32(r + 1) for r in range(world)])  # host inputs give a host array
    return expected


def _algorithms_arg(text: str) -> list[str]:
    """``--algorithm``: one algorithm, or several comma-separated (they take turns), each ``auto`` or a known one."""
    names = [t.strip() for t in text.split(",")]
    bad = [t for t in names if t not in ("auto", *ALLREDUCE)]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of auto, {', '.join(ALLREDUCE)}, comma-separated, "
                                         "each once")
    return names


#: Blocks of calls per size when several algorithms take turns.
TURNS = 5


def _ran(group: ProcessGroup) -> str:
    """The allreduce algorithm of the group's last collective, from its records ("deterministic ring" -> "ring")."""
    from ..errors import GradcollError

    rec: CollectiveRecord = group.stats().recent[-1]
    names = [w for w in rec.algorithm.replace("(", " ").split() if w in ALLREDUCE]
    if rec.op != "allreduce" or len(names) != 1:
        raise GradcollError(f"rank {group.rank}: the last record is {rec.op} {rec.algorithm!r}, not an allreduce of a known algorithm")
    return names[0]


def worker_main(argv: Sequence[str] | None = None) -> int:
    """One rank of the benchmark (started by `run_from_args` through the launcher)."""
    from ..group import init_process_group

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs=2, type=parse_size, default=[4 << 10, 64 << 20])
    ap.add_argument("--algorithm", type=_algorithms_arg, default=["auto"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--wire-dtype", default=None)
    a = ap.parse_args(argv)
    kw: dict[str, Any] = {}
    if a.deterministic:
        kw["deterministic"] = True
    if a.wire_dtype:
        kw["wire_dtype"] = a.wire_dtype
    group = init_process_group(os.environ.get("GRADCOLL_BACKEND", "tcp"), "env://", timeout=120.0)
    rank, world = group.rank, group.size
    transport = getattr(getattr(group, "transport", None), "name", "?")
    algos: list[str] = a.algorithm
    blocks = [a.iters] if len(algos) == 1 else [len(r) for r in np.array_split(np.arange(a.iters), TURNS) if len(r)]
    for nbytes in sizes_between(*a.sizes):
        count = nbytes // 4
        base = (np.arange(count) % 13).astype(np.float32)
        bufs = {algo: base * np.float32(rank + 1) for algo in algos}
        laps = {algo: np.empty(a.iters) for algo in algos}
        ran = {}
        for algo in algos:
            for _ in range(a.warmup):
                group.allreduce(bufs[algo], op="mean", algorithm=algo, **kw)
        done = 0
        for block in blocks:  # one algorithm's calls, then the next's, a block each (all of them, with one)
            for algo in algos:
                group.barrier()
                buf, lap = bufs[algo], laps[algo]
                t1 = time.perf_counter()
                for i in range(done, done + block):
                    # Means of identical small-integer-derived values are exact: buf stays put.
                    group.allreduce(buf, op="mean", algorithm=algo, **kw)
                    t2 = time.perf_counter()
                    lap[i], t1 = t2 - t1, t2
                ran[algo] = _ran(group)
            done += block
        for algo in algos:
            _row(group, a, nbytes, count, ran[algo], algo, laps[algo],
                 int(np.count_nonzero(bufs[algo] != _expected(base, world))), transport)
    group.close()
    return 0


def _row(group: ProcessGroup, a: argparse.Namespace, nbytes: int, count: int, algorithm: str, requested: str,
         laps: np.ndarray, wrong: int, transport: str) -> None:
    """Gather every rank's statistics of ``laps``; rank 0 prints the row."""
    world = group.size
    stats = group.allgather(np.array([laps.mean(), np.median(laps), wrong], np.float64))
    if group.rank == 0:
        mean_us, median_us = stats[:, 0] * 1e6, stats[:, 1] * 1e6
        algbw = nbytes / (mean_us.max() * 1e-6) / 1e9
        row = {
            "size": nbytes, "count": count, "dtype": "float32",
            "algorithm": algorithm, "algorithm_requested": requested,
            "mode": "deterministic" if a.deterministic else f"{a.wire_dtype} wire" if a.wire_dtype else "plain",
            "transport": transport, "ranks": world, "iters": a.iters,
            "iter_mean_us_avg_over_ranks": float(mean_us.mean()),
            "iter_mean_us_min_over_ranks": float(mean_us.min()),
            "iter_mean_us_max_over_ranks": float(mean_us.max()),
            "iter_median_us_avg_over_ranks": float(median_us.mean()),
            "algbw_GBps": float(algbw),
            "busbw_GBps": float(algbw * (2 * (world - 1) / world if world > 1 else 1.0)),
            "wrong": int(stats[:, 2].sum()),
        }
        print(_TAG + json.dumps(row), flush=True)


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


def build_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    """The ``bench`` argument parser."""
    from ._args import non_negative_int, positive_int, subcommand, writable_path

    epilog = "\n".join([
        textwrap.fill("Sizes are bytes: 4096, or with a binary suffix, 4K, 1M, 1G (K = 1024). The sweep doubles from "
                      "--min-size to --max-size. Times are per allreduce: each rank's mean (or median) over --iters "
                      "calls, then the average, least or greatest of that over the ranks; the bandwidths use the "
                      "slowest rank's mean.", 79),
        "", "--json writes one row per size with these fields:",
        *(textwrap.fill(v, 79, initial_indent=f"  {k:<30} ", subsequent_indent=" " * 33) for k, v in FIELDS)])
    p = subcommand(sub, "bench", "time allreduce over local ranks and print an nccl-tests-style table",
                   "Time allreduce over N local ranks, size by size, check every result against the exact mean, "
                   "and print a table of times and bandwidths (nccl-tests style).", epilog)
    p.add_argument("-n", "--nprocs", type=positive_int, default=2, metavar="N", help="number of ranks")
    p.add_argument("--backend", default="shm", choices=["tcp", "shm"], help="transport between the ranks")
    p.add_argument("--algorithm", type=_algorithms_arg, default="auto", metavar="ALGO[,ALGO...]",
                   help=f"allreduce algorithm: auto (one per size from the fitted cost model) or {', '.join(ALLREDUCE)}; "
                        "several, comma-separated, take turns in the same processes")
    p.add_argument("--min-size", type=_size_arg, default="4K", metavar="SIZE", help="smallest buffer per rank: bytes, or with a K, M or G suffix")
    p.add_argument("--max-size", type=_size_arg, default="64M", metavar="SIZE", help="largest buffer per rank: bytes, or with a K, M or G suffix")
    p.add_argument("--iters", type=positive_int, default=20, metavar="N", help="timed allreduces per size")
    p.add_argument("--warmup", type=non_negative_int, default=3, metavar="N", help="untimed allreduces per size before them")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--deterministic", action="store_true", help="time allreduce(deterministic=True)")
    mode.add_argument("--wire-dtype", default=None, choices=["bf16", "fp16"],
                      help="time allreduce(wire_dtype=...) (default: float32 on the wire)")
    p.add_argument("--json", dest="json_path", type=writable_path, default=None, metavar="PATH",
                   help="write the rows to this JSON file (fields below; default: none written)")
    p.add_argument("--plot", dest="plot_path", type=writable_path, default=None, metavar="PATH",
                   help="draw busbw against size into this PNG; needs matplotlib: pip install 'gradcoll[plot]' "
                        "(default: none drawn)")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """What one argument cannot check alone; ``p.error`` (exit status 2) before any rank starts."""
    if a.min_size > a.max_size:
        p.error(f"--min-size ({a.min_size} B) is larger than --max-size ({a.max_size} B)")
    if a.plot_path:
        try:
            pyplot()
        except ImportError as e:
            p.error(f"--plot needs matplotlib, which cannot be imported here ({e}): pip install 'gradcoll[plot]'")


def run_from_args(a: argparse.Namespace) -> int:
    """Launch the ranks, render the table, write --json/--plot; 1 when a rank failed or a result was wrong."""
    from .launch import launch

    sizes = sizes_between(a.min_size, a.max_size)
    mode = " deterministic" if a.deterministic else f" wire {a.wire_dtype}" if a.wire_dtype else ""
    print(f"# gradcoll bench: {a.nprocs} ranks, backend {a.backend}, algorithm {','.join(a.algorithm)}{mode}, "
          f"{a.iters} iters after {a.warmup} warm-up")
    print(f"# time: per allreduce, each rank's mean over the {a.iters} iters, then avg/min/max over the ranks; "
          "algbw = size / time max; busbw = algbw x 2(n-1)/n")
    print(HEADER)
    col = _Collector(len(sizes) * len(a.algorithm), sys.stderr.isatty())
    cmd = [sys.executable, "-m", "gradcoll.cli.bench", "--worker", "--sizes", str(a.min_size), str(a.max_size),
           "--algorithm", ",".join(a.algorithm), "--iters", str(a.iters), "--warmup", str(a.warmup)]
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
    wrong = sum(r["wrong"] for r in col.rows)
    if wrong:
        print(f"gradcoll bench: {wrong} elements differ from the exact mean", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # python -m gradcoll.cli.bench: the same as `gradcoll bench`, or one rank of it (--worker)
    sys.exit(module_main(worker_main, build_parser, check_args, run_from_args))
