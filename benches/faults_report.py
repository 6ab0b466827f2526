"""Turn the measurements of ``make faults`` (JSON lines) into the table of docs/reliability.md.

Usage: ``python benches/faults_report.py build/faults.jsonl docs/reliability.md``. The table
replaces everything between the ``<!-- faults:begin -->`` and ``<!-- faults:end -->``
markers; the rest of the page is left as written. Rows of an area (collective, mpi,
coordinator, soak) that the records do not measure are kept from the page as they were,
so one area can be rerun alone.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Any

BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs) * 1000:.0f} / {max(xs) * 1000:.0f}"


def _row(key: tuple[str, ...], recs: list[dict[str, Any]]) -> str:
    area, transport, algorithm, fault, buffer = key
    dets = [d for r in recs for d in r.get("detection", []) if d is not None]
    errors = sorted({e for r in recs for e in r.get("errors", [])})
    victims = sorted({r["victim"] for r in recs if r.get("victim") is not None})
    wrong = sum(r.get("wrong", 0) for r in recs)
    hung = sum(len(r.get("hung", [])) for r in recs)
    leaked = sum(len(r.get("leaked_segments", [])) for r in recs)
    failed = sum(1 for r in recs if r.get("problems"))
    if area == "soak":
        lost = (f"{wrong} wrong of {sum(r['verified'] for r in recs) + wrong}; private RSS "
                f"+{max(r['rss_growth'] for r in recs) >> 10} KiB; fds +{max(r['fd_growth'] for r in recs)}")
    else:
        parts = [f"{wrong} wrong results" if wrong else "nothing", f"{hung} hung" if hung else "",
                 f"{leaked} shm segments left" if leaked else ""]
        lost = ", ".join(p for p in parts if p)
    where = " / ".join(x for x in (transport, algorithm) if x)
    who = f" (rank {', '.join(map(str, victims))})" if victims else ""
    ok = "pass" if not failed else f"**{failed} failed**"
    size = f", {buffer}" if buffer else ""
    named = sum(1 for r in recs if r.get("root_named", not r.get("problems")))
    roots = f"; root cause named by every survivor in {named} of {len(recs)}" if area == "collective" else ""
    return f"| {area} | {where} | {fault}{size}{who} | {len(recs)} | {_ms(dets)} | {', '.join(errors) or '-'}{roots} | {lost} | {ok} |"


def table(records: list[dict[str, Any]]) -> str:
    """The markdown table, one row per (area, transport, algorithm, fault)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        key = (r["area"], r.get("transport") or "", r.get("algorithm") or "", r["fault"], r.get("buffer") or "")
        groups[key].append(r)
    order = {"collective": 0, "mpi": 1, "coordinator": 2, "soak": 3, "security": 4}
    lines = ["| area | transport / algorithm | fault, buffer (victim) | tried | detection ms (median / max) | "
             "what the others raised | lost | verdict |", "|---|---|---|---|---|---|---|---|"]
    lines += [_row(k, groups[k]) for k in sorted(groups, key=lambda k: (order.get(k[0], 9), k))]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry point: ``faults_report.py RECORDS.jsonl PAGE.md``."""
    src, page = argv[1], argv[2]
    with open(src, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    with open(page, encoding="utf-8") as f:
        text = f.read()
    head, _, rest = text.partition(BEGIN)
    old, _, tail = rest.partition(END)
    areas = {r["area"] for r in records}
    kept = [line for line in old.strip().splitlines()[2:] if line.split("|")[1].strip() not in areas]
    with open(page, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{table(records)}\n" + "".join(f"{line}\n" for line in kept) + f"{END}{tail}")
    bad = sum(1 for r in records if r.get("problems"))
    print(f"{len(records)} scenario runs, {bad} with problems -> {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
