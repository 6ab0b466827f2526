"""One rank of the MPI fault scenario, run under ``mpirun -n 4`` by test_mpi.py.

Every rank runs checked allreduces over the mpi transport; rank 2 SIGKILLs
itself inside the third one (after its first transport call). Each rank
prints one line per event (``EVENT <rank> <what> <monotonic time> <detail>``)
so the test can tell what the survivors saw before mpirun tore the job down.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np


def event(rank: int, what: str, detail: str) -> None:
    """One event as one write of one whole line (print may write the text and its newline apart)."""
    os.write(1, f"EVENT {rank} {what} {time.monotonic()} {detail}\n".encode())


def main() -> None:
    from gradcoll.group.process_group import ProcessGroup
    from gradcoll.transport import mpi

    algo = sys.argv[1] if len(sys.argv) > 1 else "ring"
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    t = mpi.create(None, world.Get_rank(), world.Get_size(), timeout=2.0)
    g = ProcessGroup(t, timeout=2.0)
    rank, size = g.rank, g.size
    event(rank, "up", f"pid={os.getpid()}")
    for i in range(6):
        if i == 3 and rank == 2:
            event(rank, "kill", "-")
            os.kill(os.getpid(), signal.SIGKILL)
        buf = np.arange(1000, dtype=np.float64) * (rank + 1) + i
        try:
            g.allreduce(buf, op="sum", algorithm=algo)
        except BaseException as e:  # noqa: BLE001 - what a survivor sees is the point
            event(rank, "raised", f"{type(e).__name__}: {e}")
            return
        ok = np.array_equal(buf, np.arange(1000, dtype=np.float64) * (size * (size + 1) // 2) + size * i)
        event(rank, "ok" if ok else "WRONG", f"call {i}")
    g.close()


if __name__ == "__main__":
    main()
