"""A three-rank inference pipeline with gradcoll.node: a coordinator, a worker and a fixed-function board.

Rank 0 (this process) is the coordinator. Rank 1 is a general worker that
runs a shipped stage (linear -> gelu, weights in .npy files it reads by
file:// URI). Rank 2 plays a fixed-function accelerator: a
LoopbackFixedFunction that doubles its 4-element input, standing in for an
FPGA. Rank 0 collects their capabilities, ships each its stage as JSON,
pushes activations through the pipeline and checks the results against
NumPy. Each rank is a separate process that finds the others through the
rendezvous store on rank 0's address.

Run:  python examples/node_pipeline.py [--topology mesh|star] [--inputs N]   (a few seconds)

Or start each rank yourself (any machines that can reach rank 0)::

    RANK=1 WORLD=3 PEERS=10.0.0.1:29500 python examples/node_pipeline.py   # and RANK=2, RANK=0

(all ranks need the same --weights directory; rank 0 writes it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import tempfile
import time

import numpy as np

from gradcoll.node import (
    FixedFunction,
    LoopbackFixedFunction,
    NodeConfig,
    NodeControl,
    OpSpec,
    StageSpec,
    collect_caps,
    drive_pipeline,
    serve_fixed_function_n,
    serve_worker_n,
    ship_stage,
    weight_cache,
)

WORLD = 3
BOARD = FixedFunction("double-4", input_elems=4, output_elems=4, dtype="float32")


def write_weights(folder: str) -> StageSpec:
    """Save rank 1's weights and return its stage: 6 features -> 4, then gelu."""
    rng = np.random.default_rng(0)
    np.save(os.path.join(folder, "w.npy"), rng.normal(size=(4, 6)).astype(np.float32))
    np.save(os.path.join(folder, "b.npy"), rng.normal(size=4).astype(np.float32))

    def uri(name: str) -> str:
        return "file://" + os.path.join(folder, name)

    return StageSpec([OpSpec.of("linear", weight=uri("w.npy"), bias=uri("b.npy")), OpSpec.of("gelu")],
                     stage_id="mlp-1", device="auto")


def run_rank(cfg: NodeConfig) -> None:
    """What ranks 1 and 2 run (each in its own process)."""
    group = cfg.connect(timeout=30, kernel_backend="cython")
    try:
        if cfg.rank == 1:
            # serve_worker(group) does the same with this node's default caps
            report = serve_worker_n(group, cfg.caps(), None, NodeControl.unbounded())  # until rank 0 closes
        else:
            board = LoopbackFixedFunction(BOARD.stage_id, lambda x: 2 * x)
            report = serve_fixed_function_n(group, BOARD, board, NodeControl.unbounded())
        print(f"  rank {cfg.rank} done: {report}", flush=True)
    finally:
        group.close()


def coordinate(cfg: NodeConfig, stage: StageSpec, n_inputs: int) -> None:
    """Rank 0: collect caps, ship stages, drive the pipeline, check against NumPy."""
    group = cfg.connect(timeout=30, kernel_backend="cython")
    try:
        for caps in collect_caps(group):
            print(f"  rank {caps.rank}: {caps.role.kind} on {caps.platform}, devices {list(caps.devices)}")
        ship_stage(group, 1, stage)
        ship_stage(group, 2, StageSpec(stage_id=BOARD.stage_id))  # the board's stage is named, not described
        inputs = np.random.default_rng(1).normal(size=(n_inputs, 6)).astype(np.float32)
        start = time.perf_counter()
        outputs = drive_pipeline(group, inputs, window=4)
        took = time.perf_counter() - start
        weights = weight_cache()  # file:// .npy, the same resolver rank 1 used
        w, b = (weights(stage.ops[0].kwargs[k]) for k in ("weight", "bias"))
        h = inputs @ w.T + b
        want = 2 * 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        err = float(np.abs(np.stack(outputs) - want).max())
        print(f"  {n_inputs} activations through {cfg.wire_topology.value} pipeline in {took * 1e3:.1f} ms, "
              f"max error vs NumPy {err:.2e}")
        assert err < 1e-5
    finally:
        group.close()  # ends the workers' loops


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=("mesh", "star"), default="mesh")
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--weights", default=None, help="weights folder (default: a temporary one)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # one rank of a job started by hand or by a launcher
        cfg = NodeConfig.from_env()
        folder = args.weights or tempfile.gettempdir()
        if cfg.rank == 0:
            coordinate(cfg, write_weights(folder), args.inputs)
        else:
            run_rank(cfg)
        return
    addr = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="gradcoll-node-") as folder:
        stage = write_weights(folder)
        configs = [NodeConfig(r, WORLD).peers([addr]).topology(args.topology).device("cpu") for r in range(WORLD)]
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=run_rank, args=(configs[r],)) for r in (1, 2)]
        for p in procs:
            p.start()
        try:
            print(f"3-rank {args.topology} pipeline, rendezvous at {addr}")
            coordinate(configs[0], stage, args.inputs)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
