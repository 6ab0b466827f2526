"""gradcoll's tcp allreduce against Open MPI's TCP path and gloo, in alternating rounds, ratios of medians.

One round runs every implementation once over the sizes (``benches/compare_anchors.py``'s workers:
same ranks, sizes, timing loop, float32 mean; MPI forced onto its TCP BTL over loopback with
``--mca btl self,tcp --mca btl_tcp_if_include lo``). Rounds alternate the implementations, so a
busy machine slows all of them alike; each size's time is the median over the rounds, and the
ratio (anchor time / gradcoll time, above 1: gradcoll faster) is taken from those medians.

    python benches/bench_tcp.py -n 2 --sizes 4K 64M --rounds 5
    python benches/bench_tcp.py -n 4 --sizes 4K 64M --rounds 5 --json benches/results/tcp_4ranks.json
    python benches/bench_tcp.py -n 2 --sizes 1M 1M --rounds 5 --calls 1000 --only gradcoll-tcp,mpi-tcp

Missing anchors are skipped with a message (``pip install 'gradcoll[anchors]'``; Open MPI's ``mpirun``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import compare_anchors  # noqa: E402

IMPLS = ["gradcoll-tcp", "mpi-tcp", "gloo"]
#: gradcoll's tcp transport with its compiled send/receive loops switched off (GRADCOLL_TCP_PURE_PYTHON=1).
PURE = "gradcoll-tcp-py"


#: gradcoll's tcp allreduce with one algorithm instead of "auto": gradcoll-tcp-ring, gradcoll-tcp-halving_doubling, ...
FIXED = ("ring", "star", "recursive_doubling", "halving_doubling")


def _run(kind: str, n: int, lo: str, hi: str, repeats: int, calls: int | None = None) -> list[dict]:
    algo = kind.removeprefix("gradcoll-tcp-")
    if algo in FIXED:
        os.environ[compare_anchors.ALGORITHM_ENV] = algo  # the launched ranks inherit it
        try:
            return [{**r, "impl": kind} for r in compare_anchors.run("gradcoll-tcp", n, lo, hi, repeats, calls=calls)]
        finally:
            del os.environ[compare_anchors.ALGORITHM_ENV]
    if kind != PURE:
        return compare_anchors.run(kind, n, lo, hi, repeats, calls=calls)
    os.environ["GRADCOLL_TCP_PURE_PYTHON"] = "1"  # the launched ranks inherit it
    try:
        return [{**r, "impl": PURE} for r in compare_anchors.run("gradcoll-tcp", n, lo, hi, repeats, calls=calls)]
    finally:
        del os.environ["GRADCOLL_TCP_PURE_PYTHON"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--sizes", nargs=2, default=["4K", "64M"], help="smallest and largest size, x4 steps")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="timed loops per size in a round (median; default 3)")
    ap.add_argument("--calls", type=int, default=None,
                    help="calls per timed loop at every size (default: 300 for the small sizes down to 5 from 16 MiB; "
                         "more measures the steady state of a long run)")
    ap.add_argument("--only", default=",".join(IMPLS),
                    help=f"implementations, comma-separated (also {PURE}: the Python send/receive loops; "
                         "gradcoll-tcp-ALGO: one allreduce algorithm instead of auto, ALGO one of "
                         f"{', '.join(FIXED)})")
    ap.add_argument("--json", dest="json_path", default=None, help="write every round's rows here")
    a = ap.parse_args(argv)
    impls = [i for i in a.only.split(",") if i]
    for kind in list(impls):
        why = None if kind == PURE or kind.removeprefix("gradcoll-tcp-") in FIXED else compare_anchors._available(kind)
        if why:
            print(f"# skipping {kind}: {why}", file=sys.stderr)
            impls.remove(kind)
    rows: list[dict] = []
    for rnd in range(a.rounds):
        for kind in impls:
            print(f"# round {rnd + 1}/{a.rounds}: {kind} on {a.nprocs} ranks", file=sys.stderr, flush=True)
            for row in _run(kind, a.nprocs, a.sizes[0], a.sizes[1], a.repeats, a.calls):
                rows.append({**row, "round": rnd})
    med: dict[tuple[str, int], float] = {}
    for kind in impls:
        for s in sorted({r["size"] for r in rows}):
            ts = [r["time_us"] for r in rows if r["impl"] == kind and r["size"] == s]
            if ts:
                med[(kind, s)] = statistics.median(ts)
    base = "gradcoll-tcp"
    others = [k for k in impls if k != base]
    print(f"# allreduce, float32, mean, {a.nprocs} ranks, median over {a.rounds} alternating rounds; "
          "ratio = anchor time / gradcoll time")
    print("| size | " + " | ".join(f"{k} us" for k in impls) + " | " + " | ".join(f"tcp/{k}" for k in others) + " |")
    print("|--:|" + "--:|" * (len(impls) + len(others)))
    for s in sorted({r["size"] for r in rows}):
        label = f"{s // 1024}K" if s < 1 << 20 else f"{s >> 20}M"
        cells = [f"{med[(k, s)]:.1f}" if (k, s) in med else "-" for k in impls]
        ratios = [f"{med[(k, s)] / med[(base, s)]:.2f}" if (k, s) in med and (base, s) in med else "-"
                  for k in others]
        print(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
