"""The two-level allreduce against the flat ring over tcp: 2 "hosts" x 2 ranks on one machine, with the model's predictions.

Two ``gradcoll launch --nnodes 2`` launchers start the ranks, each with its own ``GRADCOLL_HOST``, so the
group sees two hosts of two ranks: the two-level allreduce reduces inside each "host" through shared memory
(``gradcoll.transport.routed``), between the two leaders over tcp, and back; the flat ring runs over tcp
on every link. Every rank alternates the two algorithms per size (float32, mean), ``--repeats`` loops of
``--iters`` calls, each loop between two barriers (as ``benches/compare_anchors.py`` times: a loop ends when
every rank's last call has; without the second barrier rank 0's loop ends before the others' and the ring
looks faster at small sizes than in ``benches/bench_tcp.py``); a size's time is rank 0's median loop. The predictions are the stored fitted models
(``gradcoll/model/fitted.json``): the ring under the tcp model on 4 ranks sharing the machine's cores, the
two-level allreduce as ``gradcoll.model.hierarchy`` composes it (``--cores``, default the CPUs here): its steps
inside a "host" through the shared window under the window's model, between the leaders under tcp's, plus its
fixed cost per call and rank, which ``--fit`` fits to the run (least squares on the relative errors, the steps'
terms held) and stores.

    python benches/bench_two_level.py --sizes 64K 64M
    python benches/bench_two_level.py --sizes 64K 64M --json benches/results/two_level_2x2.json
    python benches/bench_two_level.py --sizes 4K 64M --fit
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import threading
import time

import numpy as np

HERE = os.path.abspath(__file__)
TAG = "@@two-level "
ALGOS = ("ring", "two_level")
PIN_VAR = "GRADCOLL_BENCH_CPUS"


def worker(sizes: list[int], iters: int, repeats: int) -> None:
    import gradcoll

    cpus = os.environ.get(PIN_VAR)
    if cpus:  # this "host"'s own cores (--pin)
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    g = gradcoll.init_process_group("tcp", "env://", timeout=120, stall_warning_s=None)
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, np.float32)
        n = max(3, min(iters, (256 << 20) // max(nbytes, 1) // 8))
        times: dict[str, list[float]] = {a: [] for a in ALGOS}
        for a in ALGOS:
            g.allreduce(buf, algorithm=a)  # warm: the two-level links are built at the first call
        for _ in range(repeats):
            for a in ALGOS:
                g.barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    g.allreduce(buf, algorithm=a)
                g.barrier()  # every rank's last call done: no rank's loop ends while the others still work on it
                times[a].append((time.perf_counter() - t0) / n)
        if g.rank == 0:
            print(TAG + json.dumps({"size": nbytes, **{a: float(np.median(v)) * 1e6 for a, v in times.items()},
                                    "hosts": list(g.hosts or ())}), flush=True)
    g.close()


def predictions(nbytes: int, cores: float, frame_s: float) -> dict[str, float]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.model import hierarchy
    from gradcoll.model.costmodel import Node, predict, stored_models

    models = stored_models()
    tcp, window = models["tcp"][0], models["window"][0]
    node = Node(4, cores)
    up, cross = hierarchy.node_split((2, 2), node, sleeping=True)  # a tcp group's steps inside a host: the window's
    steps = hierarchy.two_level_time((2, 2), nbytes, window, tcp, node_up=up, node_cross=cross, intra="window_star")
    return {"ring": predict("ring", 4, nbytes, tcp, node=node) * 1e6, "two_level_steps": steps * 1e6,
            "frame": hierarchy.frame_time(frame_s, 4, node) * 1e6,
            "two_level": (steps + hierarchy.frame_time(frame_s, 4, node)) * 1e6}


def fit_frame(rows: list[dict], cores: float) -> float:
    """The two-level allreduce's fixed CPU per call and rank (seconds) that fits ``rows`` best: least squares on
    the relative errors, the steps' predictions held (``hierarchy.frame_s``)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.model import hierarchy
    from gradcoll.model.costmodel import Node

    k = hierarchy.frame_time(1.0, 4, Node(4, cores))  # seconds of the call per second of frame_s
    num = den = 0.0
    for r in rows:
        m = r["two_level"] * 1e-6
        p = predictions(r["size"], cores, 0.0)["two_level_steps"] * 1e-6
        num += (1.0 - p / m) * (k / m)
        den += (k / m) ** 2
    return max(0.0, num / den)


def store_frame(frame_s: float, rows: list[dict], cores: float) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.model import hierarchy
    from gradcoll.model.costmodel import FITTED_PATH

    with open(FITTED_PATH) as f:
        doc = json.load(f)
    doc[hierarchy.FRAME_KEY] = {"frame_s": frame_s, "generated_by": "python benches/bench_two_level.py --fit",
                                "layout": [2, 2], "cores": cores, "sizes": [r["size"] for r in rows]}
    with open(FITTED_PATH, "w") as f:
        json.dump(doc, f, indent=1)  # as benches/fit_costmodel.py writes it
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs=2, default=["64K", "64M"], help="smallest and largest size, x4 steps")
    ap.add_argument("--iters", type=int, default=50, help="calls per timed loop (fewer for large sizes)")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per algorithm and size (median)")
    ap.add_argument("--cores", type=float, default=float(len(os.sched_getaffinity(0))),
                    help="cores the 4 ranks share, for the predictions (default: this machine's)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the rows here")
    ap.add_argument("--pin", action="store_true",
                    help="give each \"host\" half of this machine's cores, as real hosts have cores of their own")
    ap.add_argument("--fit", action="store_true",
                    help="fit the two-level allreduce's fixed cost per call to this run and store it in the model")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from gradcoll.cli.bench import parse_size
    from gradcoll.cli.launch import free_port, launch

    sizes, s = [], parse_size(a.sizes[0])
    while s <= parse_size(a.sizes[1]):
        sizes.append(s)
        s *= 4
    if a.worker:
        worker(sizes, a.iters, a.repeats)
        return 0
    cmd = [sys.executable, HERE, "--worker", "--sizes", *a.sizes, "--iters", str(a.iters), "--repeats", str(a.repeats)]
    port, sinks, results = free_port(), [io.StringIO(), io.StringIO()], [None, None]

    mine = sorted(os.sched_getaffinity(0))
    halves = [mine[: max(1, len(mine) // 2)], mine[len(mine) // 2:] or mine]

    def node(k: int) -> None:
        env = {"GRADCOLL_HOST": f"host{k}"}
        if a.pin:
            env[PIN_VAR] = ",".join(map(str, halves[k]))
        results[k] = launch(cmd, 2, nnodes=2, node_rank=k, master_port=port, env=env,
                            prefix=False, out=sinks[k], timeout=3600)

    threads = [threading.Thread(target=node, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = [json.loads(line.split(TAG, 1)[1]) for line in sinks[0].getvalue().splitlines() if TAG in line]
    if not all(r is not None and r.ok for r in results):
        print(sinks[0].getvalue()[-3000:] + sinks[1].getvalue()[-3000:], file=sys.stderr)
        return 1
    from gradcoll.model import hierarchy

    frame_s = hierarchy.stored_frame_s()
    if a.fit:
        frame_s = fit_frame(rows, a.cores)
        store_frame(frame_s, rows, a.cores)
        print(f"# fitted: the two-level allreduce's fixed cost {frame_s * 1e6:.1f} us per call and rank (stored)")
    print(f"# 4 ranks = 2 hosts x 2 (GRADCOLL_HOST) on {a.cores:g} cores; float32 mean; median us per call; "
          f"model: the stored fitted models (two-level: the window's steps, {frame_s * 1e6:.1f} us a call and rank)")
    print("| size | ring us | two-level us | two-level / ring | ring model (err) | two-level model (err) |")
    print("|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        p = predictions(r["size"], a.cores, frame_s)
        r["model"] = p
        s = r["size"]
        label = f"{s // 1024}K" if s < 1 << 20 else f"{s >> 20}M"
        err = {k: p[k] / r[k] - 1 for k in ALGOS}
        print(f"| {label} | {r['ring']:.1f} | {r['two_level']:.1f} | {r['two_level'] / r['ring']:.2f} | "
              f"{p['ring']:.1f} ({err['ring']:+.0%}) | {p['two_level']:.1f} ({err['two_level']:+.0%}) |")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
