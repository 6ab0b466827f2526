"""Fit the alpha-beta-gamma cost model (gradcoll.costmodel) to ``gradcoll bench`` rows and check it.

Usage::

    python benches/fit_costmodel.py                      # the stored runs in benches/results/costmodel/
    python benches/fit_costmodel.py --run --ranks 2 4    # measure first (tcp and shm, every algorithm)
    python benches/fit_costmodel.py a.json b.json        # given ``gradcoll bench --json`` files

For every transport it fits one model to all rows (every algorithm, every
world size), prints it and the % error of the prediction for each measured
row; ``--min-size`` (default 64K) is the smallest size the error target
(25%) applies to and the fit uses. ``--holdout 4`` also fits on the other
world sizes only and reports the errors on that one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from typing import Any

from gradcoll.bench import parse_size
from gradcoll.costmodel import ALGORITHMS, AlphaBeta, fit, predict

HERE = os.path.dirname(os.path.abspath(__file__))
STORED = os.path.join(HERE, "results", "costmodel")


def measure(out_dir: str, ranks: list[int], transports: list[str], lo: str, hi: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for n in ranks:
        for be in transports:
            for algo in ALGORITHMS:
                path = os.path.join(out_dir, f"{be}_{algo}_{n}.json")
                subprocess.run([sys.executable, "-m", "gradcoll", "bench", "-n", str(n), "--backend", be,
                                "--algorithm", algo, "--min-size", lo, "--max-size", hi, "--iters", "10",
                                "--warmup", "2", "--json", path], check=True, stdout=subprocess.DEVNULL)
                paths.append(path)
    return paths


def errors(rows: list[dict[str, Any]], model: AlphaBeta) -> list[tuple[dict[str, Any], float, float]]:
    out = []
    for r in rows:
        pred = predict(r["algorithm"], r["ranks"], r["size"], model) * 1e6
        out.append((r, pred, 100.0 * (pred - r["time_avg_us"]) / r["time_avg_us"]))
    return out


def report(rows: list[dict[str, Any]], min_size: int, holdout: int | None,
           fit_ranks: list[int] | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for tr in sorted({r["transport"] for r in rows}):
        sel = [r for r in rows if r["transport"] == tr and r["algorithm"] in ALGORITHMS]
        used = [r for r in sel if r["size"] >= min_size]
        model = fit([r for r in used if fit_ranks is None or r["ranks"] in fit_ranks])
        print(f"\n## {tr}: {model.describe()}  (fitted on rows >= {min_size} B, ranks {fit_ranks or 'all'})")
        print(f"{'ranks':>5} {'algorithm':>18} {'size':>10} {'measured us':>12} {'model us':>10} {'err %':>7}")
        errs = errors(sel, model)
        for r, pred, e in errs:
            flag = "" if r["size"] < min_size or abs(e) <= 25 else "  <-- over 25%"
            print(f"{r['ranks']:>5} {r['algorithm']:>18} {r['size']:>10} {r['time_avg_us']:>12.1f} {pred:>10.1f} "
                  f"{e:>+7.1f}{flag}")
        entry: dict[str, Any] = {"model": model.__dict__}
        for n in sorted({r["ranks"] for r in sel}):
            big = [abs(e) for r, _, e in errs if r["size"] >= min_size and r["ranks"] == n]
            ok = sum(e <= 25 for e in big)
            print(f"{n} ranks, from {min_size} B: max |error| {max(big):.1f}%, mean {sum(big) / len(big):.1f}%, "
                  f"{ok}/{len(big)} rows within 25%")
            entry[f"max_abs_err_pct_{n}"] = max(big)
        if holdout is not None and any(r["ranks"] == holdout for r in used):
            train = [r for r in used if r["ranks"] != holdout]
            m2 = fit(train)
            test = [abs(e) for _, _, e in errors([r for r in used if r["ranks"] == holdout], m2)]
            print(f"hold-out: fitted without {holdout} ranks ({m2.describe()}): {holdout}-rank max |error| "
                  f"{max(test):.1f}%, mean {sum(test) / len(test):.1f}%")
            entry["holdout_max_abs_err_pct"] = max(test)
        result[tr] = entry
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="gradcoll bench --json files (default: the stored runs)")
    ap.add_argument("--run", action="store_true", help="run gradcoll bench first")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"])
    ap.add_argument("--sizes", nargs=2, default=["4K", "32M"])
    ap.add_argument("--out", default=STORED, help="where --run writes its JSON files")
    ap.add_argument("--min-size", default="64K")
    ap.add_argument("--holdout", type=int, default=None)
    ap.add_argument("--fit-ranks", type=int, nargs="+", default=None, help="fit only on these world sizes")
    ap.add_argument("--json", dest="json_path", default=None, help="write the fitted models here")
    a = ap.parse_args()
    paths = measure(a.out, a.ranks, a.transports, *a.sizes) if a.run else (a.files or sorted(glob.glob(
        os.path.join(STORED, "*.json"))))
    rows: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            rows.extend(json.load(f))
    res = report(rows, parse_size(a.min_size), a.holdout, a.fit_ranks)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
