"""Two or more values of one of the tcp step's constants, taking turns in the same processes: medians per value.

Launches ``-n`` local ranks over tcp (``gradcoll launch``). Each round sets
``gradcoll.transport.tcp_fast.KNOB`` to every value in turn and times a loop
of allreduces (float32, mean, ``auto``) per value; rank 0 prints the median
and the best loop time per call of each value. The values take turns in
the same processes, so the placement of the ranks on the cores, which on a
machine with more ranks than cores moves whole runs by a large factor, is the same for
all of them. Each value also gets the CPU its loops cost, every rank's user
and system time (``getrusage``) summed over the ranks, per call: with more
ranks than cores that bounds the time, and it varies far less between runs.
Used for ``STEP_SPIN_S`` and ``STAGE_MAX`` (docs/performance.md,
"Ranks that stay runnable"). ``--sockbuf`` connects the group with those
socket buffers (``tcp.create``'s ``sockbuf``); they are set before the links
connect, so each value takes a launch of its own ("When the cores are
shared" compares launches taking turns).

    python benches/ab_tcp_knob.py -n 4 --sizes 1M 4M 16M --knob STEP_SPIN_S --values 5e-5 5e-4 --rounds 6
    python benches/ab_tcp_knob.py -n 2 --sizes 1M 4M --knob STAGE_MAX --values 8M 0
    python benches/ab_tcp_knob.py -n 4 --sizes 1M 4M 16M --knob STEP_SPIN_S --values 5e-4 --sockbuf 4M
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
import sys
import time

HERE = os.path.abspath(__file__)
KNOBS = ("STEP_SPIN_S", "STAGE_MAX", "PIECE_BYTES")


def _value(knob: str, text: str) -> float | int:
    from gradcoll.cli.bench import parse_size

    return float(text) if knob == "STEP_SPIN_S" else parse_size(text)


def worker(sizes: list[int], knob: str, values: list[str], rounds: int, sockbuf: int | None = None) -> None:
    import numpy as np

    import gradcoll
    from gradcoll.transport import tcp_fast

    g = gradcoll.init_process_group("tcp", "env://", timeout=300, **({} if sockbuf is None else {"sockbuf": sockbuf}))
    parsed = [_value(knob, v) for v in values]
    for size in sizes:
        buf = np.ones(size // 4, np.float32)
        iters = max(5, min(200, int(4e8 // max(size, 1))))  # about 0.4 GB per loop
        for _ in range(5):
            g.allreduce(buf)
        got: dict[str, list[float]] = {v: [] for v in values}
        cpu = np.zeros(len(values))  # this rank's user + system seconds per value
        for _ in range(rounds):
            for j, (text, v) in enumerate(zip(values, parsed, strict=True)):
                setattr(tcp_fast, knob, v)
                g.barrier()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                for _ in range(iters):
                    g.allreduce(buf)
                got[text].append((time.perf_counter() - t0) / iters * 1e6)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu[j] += r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        g.allreduce(cpu, op="sum")  # every rank's, summed
        if g.rank == 0:
            cells = "  ".join(f"{knob}={t}: median {statistics.median(x):.0f} us, best {min(x):.0f}, "
                              f"cpu {cpu[j] / (rounds * iters) * 1e6:.0f} us"
                              for j, (t, x) in enumerate(got.items()))
            print(f"@@ {g.size} ranks, {size} B, {iters} calls x {rounds} rounds: {cells}", flush=True)
    g.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--sizes", nargs="+", default=["1M", "4M"], help="bytes per rank, e.g. 1M 4M (default 1M 4M)")
    ap.add_argument("--knob", choices=KNOBS, default="STEP_SPIN_S", help="the constant of tcp_fast to vary")
    ap.add_argument("--values", nargs="+", required=True, help="its values (seconds, or bytes as 8M)")
    ap.add_argument("--rounds", type=int, default=6, help="turns of every value (default 6)")
    ap.add_argument("--sockbuf", default=None, help="the links' socket buffers, e.g. 256K (default: tcp.create's)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.cli.bench import parse_size

    sizes = [parse_size(s) for s in a.sizes]
    if a.worker:
        worker(sizes, a.knob, a.values, a.rounds, None if a.sockbuf is None else parse_size(a.sockbuf))
        return 0
    from gradcoll.cli.launch import launch

    cmd = [sys.executable, HERE, "--worker", "--knob", a.knob, "--rounds", str(a.rounds),
           "--sizes", *map(str, sizes), "--values", *a.values] + ([] if a.sockbuf is None else ["--sockbuf", a.sockbuf])
    sink = io.StringIO()
    res = launch(cmd, a.nprocs, backend="tcp", prefix=False, out=sink, timeout=1800)
    for line in sink.getvalue().splitlines():
        if line.startswith("@@"):
            print(line[3:])
    if not res.ok:
        print(sink.getvalue()[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
