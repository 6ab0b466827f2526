"""``gradcoll stragglers TRACE.json [...]``: print the ranks whose late arrival made the others wait.

The analysis is [`gradcoll.observe.stragglers.rank_stragglers`][gradcoll.observe.stragglers.rank_stragglers];
this module is its command line.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..observe.stragglers import rank_stragglers
from ..observe.trace import load_events, merge
from ._args import existing_file, non_negative_int, subcommand, writable_path

__all__ = ["build_parser", "run_from_args"]


def build_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``stragglers`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = subcommand(sub, "stragglers", "name the ranks whose late arrival made the others wait (from traces)",
                   "Read Chrome traces written by ProcessGroup(trace=...) or stop_trace() (per-rank files or one "
                   "merged file) and print the ranks whose late arrival made the others wait most.")
    p.add_argument("traces", nargs="+", type=existing_file, metavar="TRACE.json", help="trace files (one per rank, or merged)")
    p.add_argument("--top", type=non_negative_int, default=0, metavar="N", help="print only the first N ranks (default: 0, all)")
    p.add_argument("--merge", metavar="OUT.json", type=writable_path, help="also write the traces merged into one file (default: none)")
    return p


def run_from_args(a: argparse.Namespace) -> int:
    """Run ``gradcoll stragglers``; 0 on success, 1 when no collective appears on two ranks."""
    if a.merge:
        merge(a.traces, a.merge)
    rows, summary = rank_stragglers(load_events(a.traces))
    if not summary["collectives"]:
        print("no collective appears in the traces of two or more ranks")
        return 1
    print(f"{int(summary['collectives'])} collectives matched across ranks; arrival skew mean "
          f"{summary['mean_skew_s'] * 1e3:.3f} ms, max {summary['max_skew_s'] * 1e3:.3f} ms")
    print(f"{'rank':>4}  {'last':>11}  {'made others wait':>16}  {'mean lateness':>13}  {'own wait':>10}")
    for s in rows[: a.top or None]:
        print(f"{s.rank:>4}  {f'{s.last}/{s.collectives}':>11}  {s.caused_wait_s * 1e3:>13.3f} ms  "
              f"{s.mean_lateness_s * 1e3:>10.3f} ms  {s.own_wait_s * 1e3:>7.3f} ms")
    return 0
