"""Predicted allreduce scaling (docs/scaling.md): tables, crossovers and the plot, from gradcoll.costmodel.

Usage: ``python benches/scaling_tables.py [--plot docs/img/scaling_busbw.png]`` prints Markdown.
"""

from __future__ import annotations

import argparse
import sys

from gradcoll.algorithms import auto_thresholds
from gradcoll.algorithms.simulate import simulate
from gradcoll.model.costmodel import ALGORITHMS, AlphaBeta, best, busbw, crossovers, link_model, predict, stored_models
from gradcoll.model.hierarchy import flat_time, step_times
from gradcoll.model.window_model import WINDOW_MODEL

#: Reduction throughput, from the kernel runs of docs/performance.md (2 inputs x 1e7 float32: 40 MB of incoming contribution).
REDUCE_BPS = 40e6 / 5.52e-3
LINKS = {"10 Gbit/s": link_model(10, 25e-6, REDUCE_BPS), "100 Gbit/s": link_model(100, 5e-6, REDUCE_BPS)}
RANKS = (8, 32, 128, 1024)
SIZES = (1 << 20, 16 << 20, 256 << 20, 1 << 30)
SHORT = {"ring": "ring", "star": "star", "recursive_doubling": "rec. doubling", "halving_doubling": "halving-doubling",
         "two_level": "two-level"}
#: Inside a host: shared memory for the two-level allreduce's own steps, the kernel's loopback tcp for the flat
#: algorithms (a group over tcp uses tcp between ranks of one host too).
SHM_LOCAL = AlphaBeta(5e-6, 1 / 20e9, 1 / REDUCE_BPS)
TCP_LOCAL = AlphaBeta(10e-6, 1 / 5e9, 1 / REDUCE_BPS)
PER_HOST = 8
HIER_RANKS = (8, 32, 128, 1024)
HIER_SIZES = (1 << 16, 1 << 20, 16 << 20, 256 << 20)
SIM_UP_TO = 32  # ranks simulated with the real code; beyond, the closed forms alone


def human(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:.3g} {unit}" if v < 1000 else f"{v:,.0f} {unit}"  # 1,010 KiB, not 1.01e+03 KiB
    return f"{int(n)} B"


def ms(t: float) -> str:
    return f"{t * 1e3:,.2f}" if t < 10 else f"{t * 1e3:,.0f}"


def tables() -> None:
    for name, m in LINKS.items():
        print(f"\n### {name} ({m.describe()})\n")
        cols = " | ".join(f"{SHORT[a]} ms" for a in ALGORITHMS)
        print(f"| ranks | size | {cols} | best | best busbw GB/s |")
        print("|--:|--:|" + "--:|" * len(ALGORITHMS) + "--|--:|")
        for n in RANKS:
            for s in SIZES:
                ts = {a: predict(a, n, s, m) for a in ALGORITHMS}
                b = best(n, s, m)
                cells = " | ".join(ms(ts[a]) for a in ALGORITHMS)
                print(f"| {n} | {human(s)} | {cells} | {SHORT[b]} | {busbw(s, n, ts[b]) / 1e9:.2f} |")


def crossover_table() -> None:
    print("\n| link | ranks | model: best algorithm by size |")
    print("|--|--:|--|")
    for name, m in LINKS.items():
        for n in (2, 4, 8, 16, 64, 128, 1024):
            xs = crossovers(m, n, lo=1 << 10, hi=1 << 30)
            first = best(n, 1 << 10, m)
            text = SHORT[first] + "".join(f" -> {SHORT[b]} from {human(s)}" for s, _, b in xs)
            print(f"| {name} | {n} | {text} |")


def auto_table() -> None:
    """What algorithm="auto" runs: the crossovers of the stored fitted models (gradcoll/model/fitted.json)."""
    models = stored_models()
    print("\n| transport | model | ranks | `auto`: algorithm by size |")
    print("|--|--|--:|--|")
    for tr in sorted(models):
        if tr == WINDOW_MODEL:  # not a transport: the direct allreduce's schedule choice (docs/algorithms/direct.md)
            continue
        m, cores, max_ranks = models[tr]
        for n in (2, 3, 4, 8, 16, 64, 1024):
            table = auto_thresholds(n, tr)
            text = SHORT[table[0][1]] + "".join(f" -> {SHORT[a]} from {human(at)}" for at, a in table[1:])
            where = f"{n} ranks on {cores:g} cores" if cores is not None and n <= max_ranks else "a core per rank"
            print(f"| {tr} | {where} | {n} | {text} |")


def two_level_table() -> None:
    """Flat ring and recursive doubling against the two-level allreduce, 8 ranks per host (docs/scaling.md)."""
    for name, net in LINKS.items():
        print(f"\n### {name} between hosts, {PER_HOST} ranks per host\n")
        print("| ranks | hosts | size | ring ms | rec. doubling ms | two-level ms | between leaders | best |"
              " simulated two-level ms |")
        print("|--:|--:|--:|--:|--:|--:|--|--|--:|")
        for n in HIER_RANKS:
            layout = [PER_HOST] * (n // PER_HOST)
            for s in HIER_SIZES:
                ts = {a: flat_time(a, layout, s, TCP_LOCAL, net, shared_nic=True) for a in ("ring", "recursive_doubling")}
                inside, between, cross = step_times(layout, s, SHM_LOCAL, net)
                ts["two_level"] = inside + between
                sim = "-"
                if n <= SIM_UP_TO:
                    hosts = [r // PER_HOST for r in range(n)]
                    sim = ms(max(simulate("two_level", n, s, net, hosts=hosts, local=SHM_LOCAL, cross=cross)))
                b = min(ts, key=lambda a: ts[a])
                leaders = SHORT[cross] if len(layout) > 1 else "-"
                print(f"| {n} | {len(layout)} | {human(s)} | {ms(ts['ring'])} | {ms(ts['recursive_doubling'])} | "
                      f"{ms(ts['two_level'])} | {leaders} | {SHORT[b]} | {sim} |")


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    sizes = [1 << k for k in range(20, 31)]
    ranks = dict(zip((8, 128, 1024), ("-", "--", ":"), strict=True))
    colors = dict(zip(ALGORITHMS, ("C0", "C1", "C2", "C3"), strict=True))
    # One legend per panel: colour is the algorithm, line style the world size.
    handles = [Line2D([], [], color=c, label=SHORT[a]) for a, c in colors.items()]
    handles += [Line2D([], [], color="k", linestyle=st, label=f"{n} ranks") for n, st in ranks.items()]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.9), sharey=False)
    for ax, (name, m) in zip(axes, LINKS.items(), strict=True):
        for n, style in ranks.items():
            for a, color in colors.items():
                ax.plot(sizes, [busbw(s, n, predict(a, n, s, m)) / 1e9 for s in sizes], style, color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name}: predicted busbw")
        ax.set_xlabel("buffer size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        # Centre right is clear in both panels: between the star's 8-rank and 128-rank lines.
        ax.legend(handles=handles, fontsize=9, ncol=2, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    tables()
    crossover_table()
    auto_table()
    two_level_table()
    if a.plot:
        plot(a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
