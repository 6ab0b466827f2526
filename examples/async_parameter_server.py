"""An asynchronous parameter server on top of gradcoll's DistributedOptimizer.

Four workers, each in its own thread and each with its own shard of a linear
regression problem, compute gradients at different speeds (one is a
straggler) and push them to a parameter server. The server runs the
asynchronous strategy with a staleness bound: it applies whatever is pending
as soon as anything arrives, weights each update by 1/(1+staleness), and
refuses updates computed from parameters more than ``STALENESS`` steps old.

Run:  python examples/async_parameter_server.py   (a few seconds)
"""

from __future__ import annotations

import threading
import time

import numpy as np

from gradcoll.optimizer import AggregationStrategy, DistributedOptimizer, GradientUpdate, StaleUpdate

FEATURES = 8
SAMPLES_PER_WORKER = 512
BATCH = 32
STEPS = 400
STALENESS = 6
LEARNING_RATE = 0.05
# Simulated compute time per gradient (seconds); the last worker straggles.
WORKER_DELAYS = {"fast-0": 0.001, "fast-1": 0.0015, "medium": 0.003, "straggler": 0.03}
LAYERS = ("weight", "bias")


def make_shards(rng: np.random.Generator) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray, float]:
    """Each worker's (X, y) shard of y = X @ w_true + b_true + noise."""
    w_true = rng.normal(size=FEATURES)
    b_true = 0.5
    shards = {}
    for name in WORKER_DELAYS:
        x = rng.normal(size=(SAMPLES_PER_WORKER, FEATURES))
        y = x @ w_true + b_true + 0.01 * rng.normal(size=SAMPLES_PER_WORKER)
        shards[name] = (x, y)
    return shards, w_true, b_true


def loss(params: dict[str, np.ndarray], shards) -> float:
    """Mean squared error over all shards."""
    errs = [x @ params["weight"] + params["bias"][0] - y for x, y in shards.values()]
    return float(np.mean(np.concatenate(errs) ** 2))


class ParameterServer:
    """Holds the parameters, applies aggregated gradients, and moves the step on."""

    def __init__(self, optimizer: DistributedOptimizer) -> None:
        self.optimizer = optimizer
        # (step, params) is replaced as a whole, so a worker always reads a
        # consistent pair without taking a lock.
        self.state = (0, {"weight": np.zeros(FEATURES), "bias": np.zeros(1)})
        self.arrived = threading.Condition()
        self.done = threading.Event()
        self.applied_staleness: list[int] = []

    def notify(self) -> None:
        with self.arrived:
            self.arrived.notify()

    def run(self, deadline: float) -> None:
        opt = self.optimizer
        while opt.current_step < STEPS and time.monotonic() < deadline:
            with self.arrived:
                self.arrived.wait(timeout=0.01)
            step, params = self.state
            new = dict(params)
            applied = False
            for layer in LAYERS:
                agg = opt.try_aggregate(layer)
                if agg is not None:
                    new[layer] = params[layer] - LEARNING_RATE * agg.values
                    self.applied_staleness += [max(0, agg.step - s) for _, s in agg.contributions]
                    applied = True
            if applied:
                self.state = (opt.advance_step(), new)
        self.done.set()


def worker(name: str, server: ParameterServer, shard, seed: int, t0: float, rejected: dict[str, int]) -> None:
    """Pull parameters, compute a minibatch gradient, push it; repeat until the server is done."""
    rng = np.random.default_rng(seed)
    x, y = shard
    while not server.done.is_set():
        step, params = server.state
        idx = rng.integers(0, len(y), BATCH)
        err = x[idx] @ params["weight"] + params["bias"][0] - y[idx]
        grads = {"weight": 2 * x[idx].T @ err / BATCH, "bias": np.array([2 * err.mean()])}
        time.sleep(WORKER_DELAYS[name])  # stands in for the forward/backward pass
        now_ms = int((time.monotonic() - t0) * 1000)
        for layer in LAYERS:
            try:
                server.optimizer.submit_update(GradientUpdate(name, layer, grads[layer], step, now_ms), now_ms)
            except StaleUpdate:
                # The server moved on more than STALENESS steps since we read
                # the parameters; the update is dropped and we pull again.
                rejected[name] += 1
        server.notify()


def main() -> None:
    rng = np.random.default_rng(0)
    shards, w_true, b_true = make_shards(rng)
    opt = DistributedOptimizer(AggregationStrategy.asynchronous(STALENESS, weighting="inverse_staleness"))
    for name in WORKER_DELAYS:
        opt.register_worker(name)
    server = ParameterServer(opt)
    initial_loss = loss(server.state[1], shards)

    t0 = time.monotonic()
    rejected = {name: 0 for name in WORKER_DELAYS}
    threads = [
        threading.Thread(target=worker, args=(name, server, shards[name], i, t0, rejected), name=name)
        for i, name in enumerate(WORKER_DELAYS)
    ]
    for th in threads:
        th.start()
    server.run(deadline=t0 + 10.0)
    for th in threads:
        th.join()
    elapsed = time.monotonic() - t0

    step, params = server.state
    stats = opt.stats()
    print(f"async parameter server: {len(WORKER_DELAYS)} workers, staleness bound {STALENESS}, {elapsed:.2f} s")
    lag = np.array(server.applied_staleness or [0])
    print(f"  steps {step}, aggregations {stats.total_aggregations}, updates applied {len(server.applied_staleness)}")
    print(f"  staleness of applied updates: mean {lag.mean():.2f}, max {lag.max()} (weighted by 1/(1+staleness))")
    print(f"  stale updates dropped {stats.dropped_updates} (still pending at exit: {stats.pending_updates})")
    for name in WORKER_DELAYS:
        st = opt.worker_state(name)
        print(f"    {name:<10} accepted {st.total_updates:>4}  refused as stale {rejected[name]:>3}")
    err = float(np.linalg.norm(params["weight"] - w_true)) + abs(float(params["bias"][0]) - b_true)
    print(f"  loss {initial_loss:.4f} -> {loss(params, shards):.6f}; distance to the true parameters {err:.4f}")


if __name__ == "__main__":
    main()
