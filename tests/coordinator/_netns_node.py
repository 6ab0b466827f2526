"""One node of the coordinator's network-namespace test (test_netns.py): the coordinator or a worker.

``NETNS_ROLE`` is ``coordinator`` (listening on ``NETNS_ADDR:NETNS_PORT``
for ``NETNS_WORKERS`` workers) or ``worker`` (joining it). Events go to
stdout as ``@@ {json}`` lines, commands come on stdin: ``go`` runs steps
(gradient ``worker_id + 1 + step`` everywhere, checked against the exact
mean) until one raises (``failed``, with ``time.monotonic()``); ``regroup``
builds a new cluster on the next port and runs one checked step
(``regrouped``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gradcoll.coordinator import DistributedConfig, GradientServer, WorkerClient  # noqa: E402
from gradcoll.errors import GradcollError  # noqa: E402

N = 50_000
OPTS = {"heartbeat_interval_ms": 500, "heartbeat_timeout_ms": 3000, "timeout_s": 60}


def report(event: str, **fields: object) -> None:
    print("@@ " + json.dumps({"event": event, "role": os.environ["NETNS_ROLE"], **fields}), flush=True)


def expected(workers: int, step: int) -> np.ndarray:
    return np.full(N, sum(w + 1 + step for w in range(workers)) / workers, np.float32)


def serve(port: int, workers: int, steps: int | None) -> None:
    cfg = DistributedConfig.coordinator((os.environ["NETNS_ADDR"], port), workers, **OPTS)
    with GradientServer.bind(cfg) as srv:
        srv.wait_for_workers()
        srv.set_total_samples(workers * 10)
        step = 0
        while steps is None or step < steps:
            try:
                srv.send_shard_assignments(step)
                res = srv.collect_and_reduce(step)
                ok = bool(np.array_equal(res.avg_gradients, expected(workers, step)))
                srv.broadcast_averaged(step, res)
            except GradcollError as exc:
                report("failed", t=time.monotonic(), type=type(exc).__name__, message=str(exc))
                return
            report("step", step=step, ok=ok)
            step += 1
        srv.shutdown_workers()


def work(port: int) -> None:
    cfg = DistributedConfig.worker((os.environ["NETNS_COORDINATOR"], port), **OPTS)
    try:
        with WorkerClient.connect(cfg) as c:
            while (shard := c.receive_shard()) is not None:
                c.send_gradients(shard.step, np.full(N, c.worker_id() + 1 + shard.step, np.float32), 0.5, 1, 2)
                avg = c.receive_averaged()
                report("step", step=shard.step, ok=bool(np.array_equal(avg.gradients, expected(c.total_workers(),
                                                                                               shard.step))))
    except GradcollError as exc:
        report("failed", t=time.monotonic(), type=type(exc).__name__, message=str(exc))


def main() -> None:
    role, port, workers = os.environ["NETNS_ROLE"], int(os.environ["NETNS_PORT"]), int(os.environ["NETNS_WORKERS"])
    report("ready")
    for command in sys.stdin:
        command = command.strip()
        if command == "go":
            serve(port, workers, None) if role == "coordinator" else work(port)
        elif command == "regroup":
            serve(port + 1, workers, 1) if role == "coordinator" else work(port + 1)
            report("regrouped")
            return


if __name__ == "__main__":
    main()
