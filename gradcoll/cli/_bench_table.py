"""The rows of ``gradcoll bench``: their fields, sizes, the table and the plot (see `gradcoll.cli.bench`)."""

from __future__ import annotations

import json
import re
from typing import Any

from ..algorithms import ALLREDUCE

__all__ = ["FIELDS", "HEADER", "parse_size", "sizes_between", "load_rows", "format_row", "plot", "pyplot"]

#: The fields of a row, in the order written, and what each means (the ``--help`` epilog; the module docstring says more).
FIELDS: tuple[tuple[str, str], ...] = (
    ("size", "bytes of each rank's buffer"),
    ("count", "float32 elements in it"),
    ("dtype", "its element type"),
    ("algorithm", "the allreduce algorithm that ran (for --algorithm auto, the one auto picked)"),
    ("algorithm_requested", "the --algorithm given"),
    ("mode", "plain, deterministic, bf16 wire or fp16 wire"),
    ("transport", "the transport that carried the bytes"),
    ("ranks", "world size"),
    ("iters", "timed calls per rank"),
    ("iter_mean_us_avg_over_ranks", "each rank's mean time per call (us), averaged over the ranks"),
    ("iter_mean_us_min_over_ranks", "each rank's mean time per call (us), the least over the ranks"),
    ("iter_mean_us_max_over_ranks", "each rank's mean time per call (us), the greatest over the ranks"),
    ("iter_median_us_avg_over_ranks", "each rank's median time per call (us), averaged over the ranks"),
    ("algbw_GBps", "size / iter_mean_us_max_over_ranks, in 1e9 bytes/s"),
    ("busbw_GBps", "algbw x 2(n-1)/n (nccl-tests' bus bandwidth)"),
    ("wrong", "elements differing from the exact mean, summed over the ranks"),
)

#: Names rows had before; `load_rows` reads them under the current ones.
_RENAMED = {
    "time_avg_us": "iter_mean_us_avg_over_ranks",
    "time_min_us": "iter_mean_us_min_over_ranks",
    "time_max_us": "iter_mean_us_max_over_ranks",
    "time_med_us": "iter_median_us_avg_over_ranks",
    "runs_time_med_us": "runs_iter_median_us_avg_over_ranks",  # benches/fit_costmodel.py --repeat
}

_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_SIZE_FORMS = "bytes as 4096, 4K, 1M or 1G (K, M, G = 2^10, 2^20, 2^30)"


def parse_size(text: str) -> int:
    """'4K', '64M', '1G' (binary multiples, an optional trailing 'B' or 'iB') or a plain byte count -> bytes.

    Raises ValueError naming the accepted forms for anything else, or a size that is not a whole number of bytes.
    """
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"invalid size {text!r}: give {_SIZE_FORMS}")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    value = float(m.group(1)) * mult
    if value != int(value):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def sizes_between(lo: int, hi: int) -> list[int]:
    """Powers of two times ``lo`` from ``lo`` to ``hi`` bytes inclusive (``lo`` >= 1)."""
    if lo < 1:
        raise ValueError(f"the smallest size must be at least 1 byte, got {lo}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def load_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``gradcoll bench --json`` file, fields written under earlier names renamed to the current ones."""
    with open(path) as f:
        rows: list[dict[str, Any]] = json.load(f)
    for r in rows:
        for old, new in _RENAMED.items():
            if old in r and new not in r:
                r[new] = r.pop(old)
        r.setdefault("algorithm_requested", r.get("algorithm"))
    return rows


# (header, width, row field, format): the table's columns.
_COLUMNS = (
    ("size (B)", 12, "size", "d"), ("count", 11, "count", "d"), ("type", 7, "dtype", "s"),
    ("algo", max(len(a) for a in ALLREDUCE), "algorithm", "s"), ("transport", 9, "transport", "s"),
    ("time avg (us)", 13, "iter_mean_us_avg_over_ranks", ".1f"), ("time min (us)", 13, "iter_mean_us_min_over_ranks", ".1f"),
    ("time max (us)", 13, "iter_mean_us_max_over_ranks", ".1f"),
    ("algbw (GB/s)", 12, "algbw_GBps", ".2f"), ("busbw (GB/s)", 12, "busbw_GBps", ".2f"), ("#wrong", 6, "wrong", "d"),
)
#: The table's header line.
HEADER = " ".join(f"{h:>{w}}" for h, w, _, _ in _COLUMNS)


def format_row(r: dict[str, Any]) -> str:
    """One table line."""
    return " ".join(f"{r[k]:>{w}{f}}" for _, w, k, f in _COLUMNS)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """busbw against size into the PNG ``path``: one line per requested algorithm, mode and transport.

    A line's label names the algorithms that ran along it (``auto`` may pick
    a different one per size).
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r.get("algorithm_requested", r["algorithm"]), r.get("mode", "plain"), r["transport"]) for r in rows})
    for k in keys:
        sel = [r for r in rows if (r.get("algorithm_requested", r["algorithm"]), r.get("mode", "plain"), r["transport"]) == k]
        ran = list(dict.fromkeys(r["algorithm"] for r in sel))
        label = k[0] + ("" if ran == [k[0]] else " (" + ", ".join(ran) + ")") + ("" if k[1] == "plain" else " " + k[1])
        label += " / " + k[2]
        ax.plot([r["size"] for r in sel], [r["busbw_GBps"] for r in sel], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
