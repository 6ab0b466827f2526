"""``gradcoll demo`` (``make demo``): data-parallel training across local processes.

Starts N ranks with [`gradcoll.cli.launch.launch`][gradcoll.cli.launch.launch]. Each rank trains the same
small NumPy MLP on its slice of every global batch and averages gradients with
``ProcessGroup.allreduce`` (finite-checked). Rank 0 shows progress while it
runs, then replays the same global batches in one process and reports how far
the data-parallel weights are from that single-process run (float rounding),
the time spent in allreduce and the bytes moved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._args import module_main

__all__ = ["Model", "build_parser", "check_args", "run_from_args", "worker_main"]

#: Samples per training step, split evenly over the ranks.
GLOBAL_BATCH = 512


@dataclass
class Model:
    """A two-layer MLP whose parameters live in one flat float32 buffer."""

    d_in: int
    d_hidden: int
    d_out: int
    params: np.ndarray

    @classmethod
    def create(cls, d_in: int = 32, d_hidden: int = 64, d_out: int = 8, seed: int = 0) -> "Model":
        """Deterministic initialisation (the same on every rank)."""
        rng = np.random.default_rng(seed)
        n = d_in * d_hidden + d_hidden + d_hidden * d_out + d_out
        p = np.zeros(n, np.float32)
        m = cls(d_in, d_hidden, d_out, p)
        w1, _, w2, _ = m.views(p)
        w1[...] = rng.standard_normal(w1.shape) * np.sqrt(2.0 / d_in)
        w2[...] = rng.standard_normal(w2.shape) * np.sqrt(1.0 / d_hidden)
        return m

    def views(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(W1, b1, W2, b2) as views into ``flat``."""
        a = self.d_in * self.d_hidden
        b = a + self.d_hidden
        c = b + self.d_hidden * self.d_out
        return (
            flat[:a].reshape(self.d_in, self.d_hidden),
            flat[a:b],
            flat[b:c].reshape(self.d_hidden, self.d_out),
            flat[c:],
        )

    def loss_and_grad(self, x: np.ndarray, y: np.ndarray, grad: np.ndarray) -> float:
        """Mean cross-entropy over (x, y); writes d(loss)/d(params) into ``grad``."""
        w1, b1, w2, b2 = self.views(self.params)
        h = np.maximum(x @ w1 + b1, 0.0)
        z = h @ w2 + b2
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        n = x.shape[0]
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        dz = p
        dz[np.arange(n), y] -= 1.0
        dz /= n
        gw1, gb1, gw2, gb2 = self.views(grad)
        gw2[...] = h.T @ dz
        gb2[...] = dz.sum(axis=0)
        dh = (dz @ w2.T) * (h > 0)
        gw1[...] = x.T @ dh
        gb1[...] = dh.sum(axis=0)
        return loss


def make_data(n: int, d_in: int, d_out: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic classification task from a random teacher (deterministic)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    teacher = rng.standard_normal((d_in, d_out)).astype(np.float32)
    y = np.argmax(x @ teacher + 0.3 * rng.standard_normal((n, d_out)), axis=1)
    return x, y


def batch_indices(step: int, n_samples: int, global_batch: int) -> np.ndarray:
    """The global batch of ``step`` (a fixed permutation walked in order)."""
    perm = np.random.default_rng(1234 + step // max(1, n_samples // global_batch)).permutation(n_samples)
    k = step % max(1, n_samples // global_batch)
    return perm[k * global_batch : (k + 1) * global_batch]


def _hd_sent(world: int) -> float:
    """Rank 0's bytes sent by the halving-doubling allreduce, per byte of buffer (it folds in when not a power of 2)."""
    return 2 * (world - 1) / world if world & (world - 1) == 0 else 1.0


def train_single(steps: int, lr: float, global_batch: int, x: np.ndarray, y: np.ndarray) -> Model:
    """The single-process reference over the same global batches."""
    model = Model.create(x.shape[1], 64, int(y.max()) + 1)
    grad = np.zeros_like(model.params)
    for s in range(steps):
        idx = batch_indices(s, x.shape[0], global_batch)
        model.loss_and_grad(x[idx], y[idx], grad)
        model.params -= np.float32(lr) * grad
    return model


def worker_main(argv: Sequence[str] | None = None) -> int:
    """One rank of the demo (run by the launcher)."""
    from ..algorithms import select_allreduce
    from ..group import init_process_group

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--samples", type=int, default=16384)
    a = ap.parse_args(argv)

    group = init_process_group(os.environ.get("GRADCOLL_BACKEND", "tcp"), "env://", timeout=60.0)
    rank, world = group.rank, group.size
    if a.global_batch % world:
        raise SystemExit(f"--global-batch {a.global_batch} must be divisible by the world size {world}")
    x, y = make_data(a.samples, 32, 8)
    model = Model.create(32, 64, 8)
    grad = np.zeros_like(model.params)
    local = a.global_batch // world
    t_comm = 0.0
    t0 = time.perf_counter()
    losses = np.zeros(1, np.float32)
    report_every = max(1, a.steps // 10)
    for s in range(a.steps):
        idx = batch_indices(s, a.samples, a.global_batch)[rank * local : (rank + 1) * local]
        losses[0] = model.loss_and_grad(x[idx], y[idx], grad)
        tc = time.perf_counter()
        group.allreduce(grad, op="mean")  # equal shards: the mean of local means is the global mean
        group.allreduce(losses, op="mean")
        t_comm += time.perf_counter() - tc
        model.params -= np.float32(a.lr) * grad
        if rank == 0 and (s % report_every == 0 or s == a.steps - 1):
            done = (s + 1) / a.steps
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            print(f"step {s + 1:>5}/{a.steps} [{bar}] loss {losses[0]:.4f}", flush=True)
    wall = time.perf_counter() - t0
    # Every rank must hold the same weights: gather them and compare.
    gathered = group.allgather(model.params)
    spread = float(np.max(np.abs(gathered - gathered[0])))
    group.barrier()
    if rank == 0:
        ref = train_single(a.steps, a.lr, a.global_batch, x, y)
        diff = float(np.max(np.abs(ref.params - model.params)))
        scale = float(np.max(np.abs(ref.params)))
        payload = (grad.nbytes + losses.nbytes) * a.steps
        tname = getattr(getattr(group, "transport", None), "name", None)
        shared = bool(getattr(getattr(group, "transport", None), "shared_memory", False))
        algo = select_allreduce(grad.nbytes, world, tname, shared)  # what "auto" ran for the gradient
        sent = {"ring": 2 * (world - 1) / world, "star": world - 1,  # the star: rank 0 sends to every peer
                "recursive_doubling": (world.bit_length() - 1) + (world & (world - 1) != 0),
                "halving_doubling": _hd_sent(world), "direct": 1.0}.get(algo, 0.0) if world > 1 else 0  # direct: rank 0 copies its buffer into its slot
        moved = "copied into the shared window" if algo == "direct" else "sent"
        print("summary:")
        print(f"  ranks                 {world} over {getattr(getattr(group, 'transport', None), 'name', '?')}")
        print(f"  steps                 {a.steps} x global batch {a.global_batch}")
        print(f"  final loss            {losses[0]:.4f}")
        print(f"  max |w - w_single|    {diff:.3e} (weights up to {scale:.2f}; float32 eps {np.finfo(np.float32).eps:.1e})")
        print(f"  max spread over ranks {spread:.3e}")
        print(f"  time in allreduce     {t_comm:.3f} s of {wall:.3f} s ({100 * t_comm / wall:.1f}%)")
        print(f"  allreduce payload     {payload / 1e6:.2f} MB; gradients by {algo} (auto), rank 0 {moved} ~{payload * sent / 1e6:.2f} MB")
        ok = diff <= 1e-4 * max(1.0, scale) and spread == 0.0
        print(f"  result                {'OK: matches the single-process run to float rounding' if ok else 'MISMATCH'}")
        group.close()
        return 0 if ok else 1
    group.close()
    return 0


def build_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    """The ``demo`` argument parser."""
    from ._args import positive_int, subcommand

    p = subcommand(sub, "demo", "train a small model data-parallel over local ranks and check it against one process",
                   "Train a small NumPy MLP data-parallel across N local processes (gradients averaged with "
                   "allreduce), then check that the weights match a single-process run over the same batches.")
    p.add_argument("-n", "--nprocs", type=positive_int, default=4, metavar="N",
                   help=f"number of ranks; must divide the global batch of {GLOBAL_BATCH}")
    p.add_argument("--backend", default="shm", choices=["tcp", "shm"], help="transport between the ranks")
    p.add_argument("--steps", type=positive_int, default=300, metavar="N", help="training steps")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """What one argument cannot check alone; ``p.error`` (exit status 2) before any rank starts."""
    if GLOBAL_BATCH % a.nprocs:
        p.error(f"-n/--nprocs {a.nprocs} must divide the global batch of {GLOBAL_BATCH}")


def run_from_args(a: argparse.Namespace) -> int:
    """Launch the demo ranks and return the exit status."""
    from .launch import launch

    print(f"gradcoll demo: {a.nprocs} ranks over {a.backend}, {a.steps} steps", flush=True)
    res = launch(
        [sys.executable, "-m", "gradcoll.cli.demo", "--worker", "--steps", str(a.steps)],
        a.nprocs,
        backend=a.backend,
        timeout=600,
    )
    if not res.ok:
        print(f"gradcoll demo: rank {res.failed_rank} failed (exit codes {res.returncodes})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # python -m gradcoll.cli.demo: the same as `gradcoll demo`, or one rank of it (--worker)
    sys.exit(module_main(worker_main, build_parser, check_args, run_from_args))
