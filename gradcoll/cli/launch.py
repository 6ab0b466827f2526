"""``gradcoll launch``: start N local ranks of a script, like torchrun on one host (or on each of several).

Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT and GRADCOLL_BACKEND, so
``gradcoll.init_process_group()`` with ``init_method="env://"`` finds its
peers. On several hosts, start one launcher per host with ``--nnodes`` (the
number of hosts) and ``--node-rank`` (this host's number, 0 on the host of
rank 0), the same ``-n`` (ranks per host), ``--master-addr`` (host 0's
address) and ``--master-port``: host ``k`` runs ranks ``k * n .. k * n + n - 1``. Every line a child prints is
prefixed with ``[rank]``. When one child fails, the others are stopped
(SIGTERM, then SIGKILL after a grace period) and the launcher exits non-zero,
naming the rank and its exit code.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Protocol

__all__ = ["launch", "free_port", "LaunchResult", "main"]


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host``, outside the kernel's ephemeral range where it can tell.

    The port is free when returned and bound by the rendezvous a moment
    later. One the OS picked (port 0) comes from the ephemeral range, from
    which every outgoing connection and every other port-0 bind (an MPI
    runtime's, say) is served too: one of them can take it in between. So a
    random free port below that range is preferred; port 0 is the fallback.
    """
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(50):
        port = rng.randrange(10000, lo) if lo > 10000 else 0
        if port == 0:
            break
        with socket.socket(_family(host)) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's port range for port-0 binds and outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


class OutputSink(Protocol):
    """Where [`launch`][gradcoll.cli.launch.launch] writes the ranks' output: any text stream with ``write`` and ``flush``."""

    def write(self, s: str, /) -> int: ...

    def flush(self) -> None: ...


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: the first failing rank (or None) and every exit code."""

    failed_rank: int | None
    returncodes: tuple[int | None, ...]

    @property
    def ok(self) -> bool:
        """True when every rank exited 0."""
        return self.failed_rank is None and all(rc == 0 for rc in self.returncodes)


def _pump(stream: IO[bytes], rank: int, out: OutputSink, lock: threading.Lock, prefix: bool) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with lock:
            out.write(f"[{rank}] {line}" if prefix else line)
            if not line.endswith("\n"):
                out.write("\n")
            out.flush()
    stream.close()


def launch(
    cmd: Sequence[str],
    nprocs: int,
    *,
    backend: str = "tcp",
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
    prefix: bool = True,
    out: OutputSink | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
) -> LaunchResult:
    """Run ``cmd`` as ``nprocs`` ranks (node ``node_rank`` of ``nnodes``); stop all when one fails; return how it ended."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1} for {nnodes} node(s), got {node_rank}")
    if nnodes > 1 and master_port is None:
        raise ValueError("on several nodes every launcher needs the same master_port (and node 0's master_addr)")
    out = out or sys.stdout
    port = master_port or free_port(master_addr)
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    base = {**os.environ, **(env or {})}
    base.setdefault("PYTHONUNBUFFERED", "1")
    for local in range(nprocs):
        r = node_rank * nprocs + local
        child_env = {
            **base,
            "RANK": str(r),
            "WORLD_SIZE": str(nnodes * nprocs),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": str(node_rank),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            "GRADCOLL_BACKEND": backend,
        }
        p = subprocess.Popen(list(cmd), env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, r, out, lock, prefix), daemon=True)
        t.start()
        pumps.append(t)
    deadline = None if timeout is None else time.monotonic() + timeout
    failed: int | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                failed = next(r for r, c in enumerate(codes) if c is None)
                with lock:
                    out.write(f"gradcoll launch: timed out after {timeout}s; rank {failed} still running\n")
                break
            # Wait on the first live child; a short cap keeps the loop reactive to others.
            live = next((p for p in procs if p.poll() is None), None)
            if live is None:
                continue  # every child exited since the poll above: re-read their codes
            try:
                live.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        failed = -1
    finally:
        _stop_all(procs, grace)
        for t in pumps:
            t.join(timeout=grace)
    return LaunchResult(failed, tuple(p.returncode for p in procs))


def _stop_all(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=grace)


def build_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    """The ``launch`` argument parser (standalone or as a subcommand)."""
    from ._args import existing_file, port, positive_float, positive_int, subcommand

    p = subcommand(sub, "launch", "start N local ranks of a Python script (like torchrun on one host)",
                   "Start N local ranks of a Python script with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
                   "GROUP_RANK, MASTER_ADDR, MASTER_PORT and GRADCOLL_BACKEND set, so that "
                   "gradcoll.init_process_group() finds its peers. On several hosts run one launcher per host with "
                   "--nnodes and --node-rank (and the same --master-addr and --master-port). Each output line is "
                   "prefixed with [rank]; when one rank fails the others are stopped and the exit status is 1.")
    p.add_argument("-n", "--nprocs", type=positive_int, required=True, metavar="N",
                   help="number of ranks on this host (at least 1)")
    p.add_argument("--nnodes", type=positive_int, default=1, metavar="HOSTS",
                   help="number of hosts, each running its own launcher with the same -n, --master-addr and "
                        "--master-port; the world has HOSTS x N ranks")
    p.add_argument("--node-rank", type=int, default=0, metavar="K",
                   help="this host's number, 0 .. HOSTS-1 (0 hosts rank 0 and the rendezvous); it runs ranks "
                        "K*N .. K*N+N-1")
    p.add_argument("--backend", default="tcp", choices=["tcp", "shm", "inproc", "mpi"],
                   help="transport the ranks use (GRADCOLL_BACKEND)")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="HOST", help="address of rank 0's rendezvous (MASTER_ADDR)")
    p.add_argument("--master-port", type=port, default=None, metavar="PORT",
                   help="port of rank 0's rendezvous (MASTER_PORT; default: a free port)")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="stop every rank after this many seconds (default: no limit)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]")
    p.add_argument("script", type=existing_file, help="the Python script each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def run_from_args(a: argparse.Namespace) -> int:
    """Execute a parsed ``launch`` command; returns the exit status."""
    if not 0 <= a.node_rank < a.nnodes:
        print(f"gradcoll launch: --node-rank {a.node_rank} is not in 0..{a.nnodes - 1} (--nnodes {a.nnodes})",
              file=sys.stderr)
        return 2
    if a.nnodes > 1 and a.master_port is None:
        print("gradcoll launch: --nnodes > 1 needs --master-port (the same on every host) and --master-addr "
              "(the address of host 0)", file=sys.stderr)
        return 2
    res = launch(
        [sys.executable, a.script, *a.args],
        a.nprocs,
        backend=a.backend,
        master_addr=a.master_addr,
        master_port=a.master_port,
        timeout=a.timeout,
        prefix=not a.no_prefix,
        nnodes=a.nnodes,
        node_rank=a.node_rank,
    )
    if res.ok:
        return 0
    if res.failed_rank == -1:
        print("gradcoll launch: interrupted", file=sys.stderr)
        return 130
    rc = res.returncodes[res.failed_rank] if res.failed_rank is not None else None
    print(f"gradcoll launch: rank {res.failed_rank} failed with exit code {rc}; stopped the other ranks", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gradcoll.cli.launch`` (``gradcoll launch``)."""
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
