"""Helpers for transport tests that need real processes.

* :func:`spawn_ranks` runs one function per rank in fresh ``spawn`` processes
  that bootstrap through a :class:`~gradcoll.store.FileStore`, and returns
  what each rank returned.
* :func:`run_mpi` launches this file under ``mpirun`` (``python
  tests/helpers.py <scenario>``) and returns the completed process;
  :func:`mpi_skip_reason` says why MPI tests cannot run here.
* :func:`positional_params` and :func:`field_names` read an API's shape, for
  the parity tests of the front ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

MPI_HINT = "install Open MPI and mpi4py: pip install gradcoll[mpi]"


def positional_params(fn: Any) -> list[str]:
    """Names of ``fn``'s parameters that may be passed by position (``self``/``cls`` left out)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name not in ("self", "cls") and p.kind is not inspect.Parameter.KEYWORD_ONLY]


def field_names(cls: Any) -> list[str]:
    """A dataclass's field names, in order."""
    return [f.name for f in dataclasses.fields(cls)]


def _rank_main(fn: Callable[..., Any], rank: int, size: int, path: str, args: tuple, results: Any) -> None:
    from gradcoll.store import FileStore

    store = FileStore(path, timeout=30)
    try:
        results.put((rank, "ok", fn(store, rank, size, *args)))
    except BaseException as e:  # noqa: BLE001 - shipped to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}"))
    finally:
        store.close()


def spawn_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 30.0) -> list[Any]:
    """Run ``fn(store, rank, size, *args)`` in ``size`` processes; return the results by rank."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradcoll-test-") as tmp:
        path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, size, path, args, results), daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            for _ in range(size):
                rank, status, value = results.get(timeout=timeout)
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed: {value}")
                out[rank] = value
        except queue.Empty:
            raise AssertionError(f"ranks {sorted(set(range(size)) - set(out))} gave no result within {timeout}s") from None
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    return [out[r] for r in range(size)]


def mpi_skip_reason() -> str | None:
    """None when mpirun and mpi4py are both available, else why MPI tests are skipped."""
    if shutil.which("mpirun") is None:
        return f"mpirun not found; {MPI_HINT}"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return f"mpi4py not importable; {MPI_HINT}"
    return None


def run_mpi(scenario: str, n: int = 2, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``scenario`` of this file on ``n`` MPI ranks; kill the job after ``timeout`` seconds."""
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable, os.path.abspath(__file__), scenario]
    env = dict(os.environ, OMPI_MCA_btl_base_warn_component_unused="0", OMPI_MCA_rmaps_base_oversubscribe="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _mpi_main(scenario: str) -> None:
    from mpi4py import MPI

    from gradcoll import testing
    from gradcoll.transport import mpi

    comm = MPI.COMM_WORLD
    if scenario == "conformance":
        ran = testing.run_spmd(lambda: mpi.create(None, comm.rank, comm.size, timeout=30), comm.Barrier, large=8 << 20)
        print(f"rank {comm.rank} OK {len(ran)} checks: {' '.join(ran)}", flush=True)
    elif scenario == "specifics":
        import numpy as np

        from gradcoll.errors import UsageError

        t = mpi.create(None, comm.rank, comm.size, timeout=30)
        other, n = 1 - comm.rank, 64 << 20
        for bad in (lambda: t.isend(other, b"x", tag=-1), lambda: mpi.create(None, comm.rank + 1, comm.size)):
            try:
                bad()
                raise AssertionError("expected UsageError")
            except UsageError:
                pass
        out = np.empty(n, np.uint8)  # both ranks exchange 64 MiB at once
        t.sendrecv(other, np.full(n, comm.rank + 1, np.uint8), other, out, timeout=30)
        assert (out == other + 1).all()
        req = t.isend(other, np.full(n, comm.rank, np.uint8))  # a recv's wait must drive the isend
        t.recv(other, out, timeout=30)
        req.wait(30)
        assert (out == other).all()
        t.close()
        print(f"rank {comm.rank} OK specifics", flush=True)
    elif scenario == "bench":
        import time

        import numpy as np

        t = mpi.create(None, comm.rank, comm.size)
        other = 1 - comm.rank
        for n, iters in ((4096, 5000), (4 << 20, 100), (64 << 20, 10)):
            sb, rb = np.ones(n, np.uint8), np.empty(n, np.uint8)
            for _ in range(2):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    t.sendrecv(other, sb, other, rb)
                dt = (time.perf_counter() - t0) / iters
            if comm.rank == 0:
                print(f"mpi {n:>9} B sendrecv {dt * 1e6:9.1f} us {n / dt / 1e9:6.2f} GB/s per direction", flush=True)
        t.close()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _mpi_main(sys.argv[1])
