"""Data-parallel training with gradcoll.node: four processes, one shard each, momentum SGD.

Rank 0 writes a small regression problem (y = tanh(x A) + noise) and the
initial weights of a two-layer MLP to .npy files, then coordinates: it
collects every worker's capabilities, ships each a JSON TrainSpec naming
its shard, and trains its own shard alongside them. Every step mean-reduces
[flat gradients..., lane count] across the four ranks (ring in a mesh, star
in a star), so all ranks end with the same parameters. Finally rank 0 runs
the same specs in one process with ``train_local`` and shows that the
distributed run reached the same parameters.

Run:  python examples/node_training.py [--topology mesh|star] [--epochs N]   (a few seconds)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import tempfile

import numpy as np

from gradcoll.node import DataSpec, NodeConfig, OpSpec, TrainSpec, coordinate_trainer, serve_trainer, train_local

WORLD = 4
ROWS_PER_RANK = 64


def write_problem(folder: str, epochs: int) -> TrainSpec:
    """Save data and initial weights; return rank 0's spec (``.shards(WORLD)`` gives every rank's)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(WORLD * ROWS_PER_RANK, 5)).astype(np.float32)
    y = (np.tanh(x @ rng.normal(size=(5, 2))) + 0.05 * rng.normal(size=(len(x), 2))).astype(np.float32)
    arrays: dict[str, np.ndarray] = {"x": x, "y": y, "w1": rng.normal(size=(16, 5)) * 0.4, "b1": np.zeros(16),
              "w2": rng.normal(size=(2, 16)) * 0.25, "b2": np.zeros(2)}
    for name, a in arrays.items():
        np.save(os.path.join(folder, f"{name}.npy"), a.astype(np.float32))
    uri = {name: "file://" + os.path.join(folder, f"{name}.npy") for name in arrays}
    ops = [OpSpec.of("linear", weight="w1", bias="b1"), OpSpec.of("gelu"), OpSpec.of("linear", weight="w2", bias="b2")]
    lr = [0.05] * (epochs // 2) + [0.02] * (epochs - epochs // 2)  # one learning rate per epoch
    return TrainSpec(ops, [(p, uri[p]) for p in ("w1", "b1", "w2", "b2")],
                     DataSpec(uri["x"], uri["y"], shard_start=0, shard_len=ROWS_PER_RANK),
                     lr=lr, momentum=0.9, batch=16, loss="mse")


def worker(cfg: NodeConfig) -> None:
    """Ranks 1..3: announce caps, receive a TrainSpec, train (each in its own process)."""
    group = cfg.connect(timeout=30, kernel_backend="cython")
    try:
        report = serve_trainer(group, cfg.caps(), resolve=None)
        m = report.metrics
        print(f"  rank {report.rank}: {m.samples} samples, loss {m.first_loss:.4f} -> {m.last_loss:.4f}, "
              f"compute {m.compute_s * 1e3:.0f} ms, communication {m.comm_s * 1e3:.0f} ms", flush=True)
    finally:
        group.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=("mesh", "star"), default="mesh")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    addr = f"127.0.0.1:{free_port()}"
    configs = [NodeConfig(r, WORLD).peers([addr]).topology(args.topology).device("cpu") for r in range(WORLD)]
    with tempfile.TemporaryDirectory(prefix="gradcoll-train-") as folder:
        specs = write_problem(folder, args.epochs).shards(WORLD)
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(configs[r],)) for r in range(1, WORLD)]
        for p in procs:
            p.start()
        print(f"{WORLD}-rank {args.topology} training, {args.epochs} epochs, rendezvous at {addr}")
        try:
            group = configs[0].connect(timeout=30, kernel_backend="cython")
            try:
                report = coordinate_trainer(group, specs, log=lambda line: print("  " + line, flush=True))
            finally:
                group.close()
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        reference = train_local(specs)  # the same four shards, reduced with NumPy in this process
    diff = max(float(np.abs(report.params[k] - reference.params[k]).max()) for k in reference.params)
    m = report.metrics
    print(f"  rank 0: loss {m.first_loss:.4f} -> {m.last_loss:.4f} in {m.steps} steps ({m.wall_s:.2f} s)")
    print(f"  distributed vs single-process parameters: max difference {diff:.1e}")
    assert diff < 1e-4 and not any(p.exitcode for p in procs)


if __name__ == "__main__":
    main()
