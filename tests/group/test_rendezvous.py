"""init_process_group: init_method and environment parsing, rendezvous over TCP and files."""

from __future__ import annotations

import importlib.util
import multiprocessing
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradcoll.errors import BackendUnavailable, CollectiveTimeout, UsageError
from gradcoll.group.process_group import ProcessGroup
from gradcoll.group.rendezvous import DEFAULT_PORT, InitMethod, env_rank_size, init_process_group, parse_init_method
from gradcoll.store import HashStore
from gradcoll.testing import gather_ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parse_init_methods() -> None:
    env = {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "1234"}
    assert parse_init_method("env://", env) == InitMethod("tcp", "10.0.0.7", 1234)
    assert parse_init_method("env://", {}) == InitMethod("tcp", "127.0.0.1", DEFAULT_PORT)
    assert parse_init_method("tcp://node3:29501") == InitMethod("tcp", "node3", 29501)
    assert parse_init_method("tcp://[::1]:29501") == InitMethod("tcp", "::1", 29501)
    assert parse_init_method("file:///tmp/job-1") == InitMethod("file", path="/tmp/job-1")
    for bad in ("tcp://host", "tcp://host:0", "tcp://host:99999", "tcp://h:1/path", "http://h:1", "file://", ""):
        with pytest.raises(UsageError):
            parse_init_method(bad, {})
    with pytest.raises(UsageError, match="MASTER_PORT"):
        parse_init_method("env://", {"MASTER_PORT": "x"})


@pytest.mark.parametrize(
    "env, want",
    [
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1)),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (2, 4, 0)),
        ({"PMI_RANK": "5", "PMI_SIZE": "6"}, (5, 6, None)),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}, (1, 2, 1)),
        ({"RANK": "0", "PMI_RANK": "9", "WORLD_SIZE": "2"}, (0, 2, None)),  # torchrun's variables win
        ({}, (None, None, None)),
    ],
)
def test_env_rank_size(env: dict[str, str], want: tuple) -> None:
    assert env_rank_size(env) == want


def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UsageError, match="rank and world_size"):
        init_process_group("inproc")
    with pytest.raises(UsageError):
        init_process_group("inproc", rank=2, world_size=2)
    with pytest.raises(BackendUnavailable, match="nosuchbackend"):
        init_process_group("nosuchbackend", "tcp://127.0.0.1:1", rank=0, world_size=1)
    with pytest.raises(UsageError):
        init_process_group("../evil", rank=0, world_size=1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with init_process_group("inproc", timeout=5) as g:  # everything from the environment
        assert (g.rank, g.size) == (0, 1)


def in_threads(n: int, fn: Callable[[int], Any]) -> list[Any]:
    results, errors = gather_ranks(fn, n)
    for e in errors:
        if e is not None:
            raise e
    return results


def use(g: ProcessGroup) -> float:
    with g:
        x = np.full(10, g.rank + 1.0, np.float32)
        g.allreduce(x)
        return float(x[0])


@pytest.mark.parametrize("how", ["tcp", "file", "store"])
def test_inproc_ranks_meet_through_each_init_method(how: str, tmp_path: Path) -> None:
    port, path, store = free_port(), tmp_path / "rdv", HashStore(timeout=10)

    def rank(r: int) -> float:
        if how == "store":
            return use(init_process_group("inproc", rank=r, world_size=3, timeout=10, store=store))
        method = f"tcp://127.0.0.1:{port}" if how == "tcp" else f"file://{path}"
        return use(init_process_group("inproc", method, rank=r, world_size=3, timeout=10))

    assert in_threads(3, rank) == [2.0, 2.0, 2.0]
    assert not path.exists()  # the FileStore removed its file after bootstrap


def test_missing_rank_times_out() -> None:
    port = free_port()
    with pytest.raises(CollectiveTimeout):
        init_process_group("inproc", f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=0.3)


def _tcp_rank(rank: int, port: int, q: Any) -> None:
    g = init_process_group("tcp", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=30,
                           kernel_backend="cython")
    with g:
        small = g.allreduce(np.full(100, rank + 1.0, np.float32))
        big = g.allreduce(np.full(1 << 17, float(rank), np.float32), op="sum", algorithm="ring")
        g.barrier()
        q.put((rank, float(small[0]), float(big[-1]), g.seq))


@pytest.mark.skipif(importlib.util.find_spec("gradcoll.transport.tcp") is None, reason="no tcp transport yet")
def test_two_processes_over_tcp() -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tcp_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == [(0, 1.5, 1.0, 3), (1, 1.5, 1.0, 3)]
    assert all(p.exitcode == 0 for p in procs)
