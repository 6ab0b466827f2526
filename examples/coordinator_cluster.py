"""A coordinator and N worker processes train a small classifier with gradcoll's GradientServer / WorkerClient.

The coordinator/worker protocol is entrenar's: entrenar is a Rust library
for training and fine-tuning models whose distributed fine-tuning runs one
coordinator and N workers over TCP, and gradcoll's GradientServer and
WorkerClient speak its bytes (docs/coordinator.md).

Run ``python examples/coordinator_cluster.py`` (2 workers) or with
``--workers 4 --steps 80 --blocks 3``. The model is a residual MLP laid out
like entrenar's transformer: an embedding, ``--blocks`` residual blocks and
a final norm and head. Every step follows entrenar's schedule:

1. the coordinator sends each worker its shard of the dataset;
2. each worker computes gradients on a minibatch of its shard;
3. blocks are averaged in REVERSE order (as backward produces them), then
   the non-block components 0 (lm_head), 1 (final_norm), 2 (embedding);
   every worker applies each averaged gradient as soon as it arrives;
4. a GradientPayload with no gradient averages the metrics (global loss,
   accuracy).

At the end the coordinator shuts the workers down; each reports a checksum of
its parameters, which must agree (every worker applied the same averages).
A block here has 5 components (w1, b1, w2, b2, gain); entrenar's
transformer block has 9, the protocol takes any number.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import sys

import numpy as np

from gradcoll.coordinator import DistributedConfig, GradientServer, WorkerClient

__all__ = ["main"]

D_IN, D, HIDDEN, CLASSES, SAMPLES, BATCH, LR = 8, 16, 32, 4, 4096, 128, 0.3


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The same labelled dataset in every process: four noisy Gaussian clusters in 8-D."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((CLASSES, D_IN)) * 1.2
    y = rng.integers(0, CLASSES, SAMPLES)
    return (centers[y] + rng.standard_normal((SAMPLES, D_IN))).astype(np.float32), y


def init_params(blocks: int, seed: int = 1) -> dict[str, list[np.ndarray]]:
    """Identical initial parameters on every worker (same seed)."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    return {
        "blocks": [[w(D, HIDDEN), np.zeros(HIDDEN, np.float32), w(HIDDEN, D) * 0.1, np.zeros(D, np.float32),
                    np.ones(D, np.float32)] for _ in range(blocks)],
        # non-block components by wire number: 0 lm_head, 1 final_norm, 2 embedding
        "non_block": [w(D, CLASSES), np.ones(D, np.float32), w(D_IN, D)],
    }


def forward_backward(p: dict[str, list[np.ndarray]], x: np.ndarray, y: np.ndarray) -> tuple[float, int, dict]:
    """Softmax cross-entropy of the residual MLP, and its gradients (same layout as the parameters)."""
    head, fnorm, emb = p["non_block"]
    h, cache = x @ emb, []
    for w1, b1, w2, b2, g in p["blocks"]:
        a = np.tanh((h * g) @ w1 + b1)
        cache.append((h, a))
        h = h + a @ w2 + b2
    z = h * fnorm
    logits = z @ head
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    prob = e / e.sum(axis=1, keepdims=True)
    loss = float(-np.log(prob[np.arange(len(y)), y] + 1e-12).mean())
    dlogits = prob
    dlogits[np.arange(len(y)), y] -= 1.0
    dlogits /= len(y)
    grads: dict[str, list[np.ndarray]] = {"non_block": [z.T @ dlogits, None, None], "blocks": [None] * len(cache)}
    dz = dlogits @ head.T
    grads["non_block"][1] = (dz * h).sum(axis=0)
    dh = dz * fnorm
    for i in reversed(range(len(cache))):
        w1, b1, w2, b2, g = p["blocks"][i]
        h_in, a = cache[i]
        du = (dh @ w2.T) * (1.0 - a * a)
        dx = du @ w1.T
        grads["blocks"][i] = [(h_in * g).T @ du, du.sum(axis=0), a.T @ dh, dh.sum(axis=0), (dx * h_in).sum(axis=0)]
        dh = dh + dx * g
    grads["non_block"][2] = x.T @ dh
    correct = int((logits.argmax(axis=1) == y).sum())
    return loss, correct, grads


def apply(params: list[np.ndarray], flat: np.ndarray) -> None:
    """SGD step with an averaged gradient that is the concatenation of ``params``' gradients."""
    offset = 0
    for prm in params:
        prm -= LR * flat[offset : offset + prm.size].reshape(prm.shape)
        offset += prm.size


def worker_main(addr: tuple[str, int], blocks: int, secret: str | None, results: multiprocessing.Queue) -> None:
    """One worker process: join, train on the shards it is given until Shutdown, report a checksum."""
    x, y = make_data()
    params = init_params(blocks)
    cfg = DistributedConfig.worker(addr, timeout_s=60, secret=secret)
    with WorkerClient.connect(cfg, gpu_count=0, backend="cpu") as client:
        while (shard := client.receive_shard()) is not None:
            step = shard.step
            idx = np.random.default_rng((client.worker_id(), step)).integers(shard.shard_start, shard.shard_end, BATCH)
            loss, correct, grads = forward_backward(params, x[idx], y[idx])
            for b in reversed(range(blocks)):
                parts = grads["blocks"][b]
                client.send_block_gradient(step, b, blocks, np.concatenate([g.ravel() for g in parts]),
                                           [g.size for g in parts])
                apply(params["blocks"][b], client.receive_averaged_block().gradients)
            for comp in (0, 1, 2):
                client.send_non_block_gradient(step, comp, grads["non_block"][comp].ravel())
                apply([params["non_block"][comp]], client.receive_averaged_non_block().gradients)
            client.send_gradients(step, [], loss, correct, BATCH)  # no gradient: only the metrics are reduced
            client.receive_averaged()
        digest = hashlib.sha256(b"".join(a.tobytes() for part in params.values() for g in part for a in g)).hexdigest()
        results.put((client.worker_id(), digest))


def main(argv: list[str] | None = None) -> None:
    """Start a coordinator and the workers, train, shut down cleanly."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--secret", default=None, help="shared secret: workers must prove they know it to join")
    args = ap.parse_args(argv)

    cfg = DistributedConfig.coordinator("127.0.0.1:0", args.workers, timeout_s=60, secret=args.secret,
                                        shard_policy="epoch")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with GradientServer.bind(cfg) as server:
        procs = [ctx.Process(target=worker_main, args=(server.local_addr(), args.blocks, args.secret, results))
                 for _ in range(args.workers)]
        for p in procs:
            p.start()
        server.wait_for_workers()
        server.set_total_samples(SAMPLES)
        print(f"coordinator on {server.local_addr()}: {server.worker_count()} workers joined")
        for step in range(args.steps):
            server.send_shard_assignments(step)
            for b in reversed(range(args.blocks)):
                server.broadcast_averaged_block(step, server.collect_and_reduce_block(step, b))
            for comp in (0, 1, 2):
                server.broadcast_averaged_non_block(step, server.collect_and_reduce_non_block(step, comp))
            metrics = server.collect_and_reduce(step)
            server.broadcast_averaged(step, metrics)
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {metrics.global_loss:.4f}  "
                      f"accuracy {metrics.total_correct / metrics.total_samples:6.1%}")
        server.shutdown_workers()
        digests = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
    same = len(set(digests.values())) == 1
    print(f"shut down cleanly; parameters identical on all {len(digests)} workers: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
