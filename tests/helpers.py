"""Helpers for transport tests that need real processes.

* :func:`spawn_ranks` runs one function per rank in fresh ``spawn`` processes
  that bootstrap through a :class:`~gradcoll.store.FileStore`, and returns
  what each rank returned.
* :func:`run_mpi` launches this file under ``mpirun`` (``python
  tests/helpers.py <scenario>``) and returns the completed process;
  :func:`mpi_skip_reason` says why MPI tests cannot run here.
* :class:`Netns` builds a private network of "hosts" on this machine (Linux
  network namespaces on veth links to one bridge) and runs processes in
  them; :func:`netns_skip_reason` says why it cannot.
* :func:`positional_params` and :func:`field_names` read an API's shape, for
  the parity tests of the front ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
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


def spawn_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 30.0,
                dead: Sequence[int] = ()) -> list[Any]:
    """Run ``fn(store, rank, size, *args)`` in ``size`` processes; return the results by rank.

    The ranks in ``dead`` are expected to die (their result is None, and one they give anyway fails the run).
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradcoll-test-") as tmp:
        path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, size, path, args, results), daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            for _ in range(size - len(set(dead))):
                rank, status, value = results.get(timeout=timeout)
                if rank in dead:
                    raise AssertionError(f"rank {rank} was to die but gave a result: {value}")
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
    return [out.get(r) for r in range(size)]


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
    return run_mpirun([sys.executable, os.path.abspath(__file__), scenario], n, timeout)


def run_mpirun(argv: list[str], n: int, timeout: float) -> subprocess.CompletedProcess:
    """``mpirun -n n argv`` with its output; after ``timeout`` seconds its whole process group is killed.

    Killing only mpirun can leave ranks running that hold its output pipes
    (the test then waits for them past any timeout) and take the cores of
    the next job; the job runs in a session of its own, and a job that ran
    out of time returns ``-9`` with what it printed and a line saying so.
    """
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), *argv]
    env = dict(os.environ, OMPI_MCA_btl_base_warn_component_unused="0", OMPI_MCA_rmaps_base_oversubscribe="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        out, err = proc.communicate(timeout=10)
        return subprocess.CompletedProcess(cmd, -9, out, err + f"\nmpirun -n {n} killed after {timeout} s\n")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpi_reports(out: str, what: str) -> dict[str, list[str]]:
    """Each rank's ``rank R OK N <what>: names`` report in ``out``, as ``{R: names}``.

    mpirun forwards every rank's stdout through one stream, so one rank's line may run into another's, and
    terminal escapes may follow a name. Each name is one run of letters that stops where another rank's
    report starts: one way to match, so the time is linear in the output (nested repeats that could split a
    line of names many ways took minutes when an escape ended one).
    """
    name = r"(?:(?!rank \d+ OK)[a-z_])+"
    found = re.findall(r"rank (\d+) OK \d+ " + re.escape(what) + f": ({name}(?: {name})*)", out)
    return {r: names.split() for r, names in found}


def _mpi_main(scenario: str) -> None:
    from mpi4py import MPI

    from gradcoll import testing
    from gradcoll.transport import mpi

    comm = MPI.COMM_WORLD
    if scenario == "conformance":
        ran = testing.run_spmd(lambda: mpi.create(None, comm.rank, comm.size, timeout=30), comm.Barrier, large=8 << 20)
        print(f"rank {comm.rank} OK {len(ran)} checks: {' '.join(ran)}", flush=True)
    elif scenario == "window":
        ran = testing.run_window_spmd(lambda: mpi.create(None, comm.rank, comm.size, timeout=30), comm.Barrier)
        print(f"rank {comm.rank} OK {len(ran)} window checks: {' '.join(ran)}", flush=True)
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
    elif scenario == "allreduce":  # every algorithm over links, through the handshake of a transport without lenient tags
        import numpy as np

        from gradcoll.algorithms import ALLREDUCE
        from gradcoll.errors import NonFiniteError

        t = mpi.create(None, comm.rank, comm.size, timeout=30)
        r, n = comm.rank, comm.size
        ran = []
        for seq, algo in enumerate(("ring", "star", "recursive_doubling", "halving_doubling")):
            for count in (0, 1, n + 1, 70_001):
                b = np.arange(count, dtype=np.float32) % 7 + r  # small integers: exact in any order
                ALLREDUCE[algo](t, b, op="sum", seq=10 * seq + count % 10)
                assert (b == n * (np.arange(count) % 7) + n * (n - 1) / 2).all(), (algo, count)
            bad = np.ones(1000, np.float32)
            if r == 2:
                bad[3] = np.nan
            try:
                ALLREDUCE[algo](t, bad, seq=10 * seq + 9)
                raise AssertionError(f"{algo}: no NonFiniteError")
            except NonFiniteError as e:
                assert (e.contributor, e.index) == (2, 3), (algo, str(e))
            ran.append(algo)
        t.close()
        print(f"rank {r} OK {len(ran)} algorithms: {' '.join(ran)}", flush=True)
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


# -- network namespaces ---------------------------------------------------------------------------------------
NETNS_HINT = "needs Linux network namespaces as root: `ip netns` from Debian's iproute2 package"


def netns_skip_reason() -> str | None:
    """None when this process may create network namespaces, veth pairs and bridges, else why not."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        return f"`ip` not found; {NETNS_HINT}"
    probe = f"gcprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return f"`ip netns add` is not allowed here ({r.stderr.strip() or r.returncode}); {NETNS_HINT}"
    try:  # namespaces alone are not enough: the tests also need veth cables and a bridge
        for what, argv in (("veth", ["link", "add", "gcp0", "type", "veth", "peer", "name", "gcp1"]),
                           ("bridge", ["link", "add", "gcpbr", "type", "bridge"])):
            r = subprocess.run(["ip", "-n", probe, *argv], capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                return f"`ip link add ... type {what}` is not allowed here ({r.stderr.strip() or r.returncode}); {NETNS_HINT}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


class Netns:
    """``hosts`` network namespaces, each on a veth "cable" to one bridge in a switch namespace.

    Host ``i`` has address ``addr(i)`` (a /24 private to this object) on its
    end of the cable; ``pull(i)`` takes the switch's end down (``ip link set
    DEV down``: the host's packets are lost without a FIN or an RST, as when
    a cable is pulled) and ``plug(i)`` brings it back. ``popen(i, argv)``
    runs a process inside host ``i``. ``close()`` kills what it started and
    removes every namespace (and so every link), also after a failure; use it
    as a context manager. Traffic never leaves the machine.
    """

    _made = 0

    def __init__(self, hosts: int) -> None:
        Netns._made += 1
        tag = (os.getpid() * 7 + Netns._made) % 50000
        self.prefix = f"gc{tag}"  # device names stay under 15 characters
        self.subnet = f"10.{200 + tag // 254 % 50}.{tag % 254 + 1}"
        self.hosts = hosts
        self.procs: list[subprocess.Popen[str]] = []
        self._names: list[str] = []

    def ns(self, i: int) -> str:
        """The namespace of host ``i``."""
        return f"{self.prefix}h{i}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def addr(self, i: int) -> str:
        """Host ``i``'s address."""
        return f"{self.subnet}.{i + 1}"

    def cable(self, i: int) -> str:
        """The switch's end of host ``i``'s cable (a device in the switch namespace)."""
        return f"{self.prefix}s{i}"

    def _ip(self, *args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def __enter__(self) -> Netns:
        try:
            self._ip("netns", "add", self.switch)
            self._names.append(self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns, host_end, switch_end = self.ns(i), f"{self.prefix}c{i}", self.cable(i)
                self._ip("netns", "add", ns)
                self._names.append(ns)
                self._ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
                self._ip("link", "set", host_end, "netns", ns)
                self._ip("link", "set", switch_end, "netns", self.switch)
                self._ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", host_end)
                self._ip("-n", ns, "link", "set", host_end, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                self._ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
                self._ip("-n", self.switch, "link", "set", switch_end, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pull(self, i: int) -> None:
        """Pull host ``i``'s cable out of the switch."""
        self._ip("-n", self.switch, "link", "set", self.cable(i), "down")

    def plug(self, i: int) -> None:
        """Plug host ``i``'s cable back in."""
        self._ip("-n", self.switch, "link", "set", self.cable(i), "up")

    def popen(self, i: int, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Start ``argv`` inside host ``i`` (stdin and stdout are text pipes, stderr joins stdout)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env={**os.environ, **(env or {})})
        self.procs.append(p)
        return p

    def close(self) -> None:
        """Kill the processes started here and delete every namespace (their links go with them)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self._names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        self._names.clear()


class Lines:
    """The stdout lines of some processes, read by threads, taken with a bounded wait."""

    def __init__(self, procs: dict[int, subprocess.Popen[str]]) -> None:
        self.q: queue.Queue[tuple[int, str]] = queue.Queue()
        self.log: list[tuple[int, str]] = []
        for key, p in procs.items():
            threading.Thread(target=self._pump, args=(key, p), daemon=True).start()

    def _pump(self, key: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            self.q.put((key, line.rstrip("\n")))
        self.q.put((key, "@@eof"))

    def take(self, want: Callable[[int, str], bool], count: int, timeout: float) -> list[tuple[int, str]]:
        """The next ``count`` lines for which ``want(key, line)`` holds (others are kept in ``log``)."""
        got: list[tuple[int, str]] = []
        end = time.monotonic() + timeout
        while len(got) < count:
            try:
                key, line = self.q.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                tail = "\n".join(f"[{k}] {t}" for k, t in self.log[-40:])
                raise AssertionError(f"got {len(got)} of {count} lines within {timeout}s; output:\n{tail}") from None
            self.log.append((key, line))
            if want(key, line):
                got.append((key, line))
        return got


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _mpi_main(sys.argv[1])


def simd_widths(module: str) -> Any:
    """The vector widths the compiled ``module`` runs on this CPU, widest first (2 AVX-512, 1 AVX2, 0 none), each
    set in turn while the caller's loop body runs and the widest restored after; one ``None`` (nothing set) when
    the extension is not built, so a test still runs the path that serves then. The 512-bit floating-point loops,
    which the CPU's default may leave out (Intel CPUs: ``_fused.h``'s ``gc_fp512``), run at level 2 here."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        yield None
        return
    top = mod.simd_level()
    fp512 = mod.fp512()
    try:
        mod.fp512(1)
        for level in range(top, -1, -1):
            assert mod.simd_level(level) == level
            yield level
    finally:
        mod.simd_level(2)
        mod.fp512(int(fp512))
