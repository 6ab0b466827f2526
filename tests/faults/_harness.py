"""Run one collective fault scenario in real processes and judge it (see test_collectives.py).

:func:`run_collective_fault` starts ``size`` ranks (forkserver children with
gradcoll preloaded, so a scenario costs well under a second of start-up),
injects the fault, waits (always bounded) for every survivor's report and
returns an :class:`Outcome`. :func:`problems` lists what is wrong with one.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tests.faults._ranks import rank_main

STARTUP_S = 60.0  # fork, bootstrap and warm-up on a loaded 2-core machine
SHM_DIR = "/dev/shm"
OPS = {"ring": "ring allreduce", "star": "star allreduce", "recursive_doubling": "recursive-doubling allreduce",
       "direct": "direct allreduce", "halving_doubling": "halving-doubling allreduce"}


def context() -> Any:
    """A forkserver context with numpy and gradcoll imported once, in the server."""
    ctx = multiprocessing.get_context("forkserver")
    # The kernel modules too: init_process_group looks for the compiled ones, and importing numba in
    # every child costs seconds on a loaded machine.
    ctx.set_forkserver_preload(["numpy", "gradcoll", "gradcoll.rendezvous", "gradcoll.transport.tcp",
                                "gradcoll.transport.shm", "gradcoll.kernels.cython_backend",
                                "gradcoll.kernels.numba_cpu", "tests.faults._ranks"])
    return ctx


@dataclass
class Outcome:
    """What happened in one scenario."""

    transport: str
    algorithm: str
    fault: str
    victim: int
    timeout: float
    buffer: str = "mixed"
    t_fault: float | None = None  # monotonic time of the kill or stop (None for a stall)
    t_enter: dict[int, float] = field(default_factory=dict)
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)  # ranks still alive at the end (killed by the harness)
    leaked_segments: list[str] = field(default_factory=list)
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def survivors(self) -> list[int]:
        """Ranks other than the victim."""
        return sorted(r for r in self.exitcodes if r != self.victim)

    def detection(self, rank: int) -> float | None:
        """Seconds from the fault to ``rank``'s exception: from the kill, or from the survivor's own call
        for a stall or a stop (which it can only tell by its timeout)."""
        rep = self.reports.get(rank, {})
        if "t_exc" not in rep:
            return None
        start = self.t_fault if self.t_fault is not None and self.fault.startswith("kill") else rep["t_call"]
        return float(rep["t_exc"] - start)


def _segments(pids: list[int]) -> list[str]:
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(n for n in os.listdir(SHM_DIR) if any(n.startswith(f"gcshm-{p}-") for p in pids))


def run_collective_fault(transport: str, algorithm: str, fault: str, *, size: int = 4, victim: int = 2,
                         timeout: float = 2.0, buffer: str = "mixed", warm: int = 3, after: int = 3,
                         kill_after: int = 2) -> Outcome:
    """Run ``fault`` ("kill", "kill-mid", "stall" or "stop-mid") on rank ``victim`` of a ``size``-rank group.

    ``buffer`` names the allreduce sizes (``_ranks.BUFFERS``: "mixed", "4KiB", "64MiB").
    """
    ctx = context()
    out = Outcome(transport, algorithm, fault, victim, timeout, buffer=buffer)
    with tempfile.TemporaryDirectory(prefix="gradcoll-faults-") as tmp:
        cfg = {"transport": transport, "algorithm": algorithm, "size": size, "victim": victim, "fault": fault,
               "timeout": timeout, "boot_timeout": STARTUP_S, "warm": warm, "after": after, "buffer": buffer,
               "kill_after": kill_after, "store": os.path.join(tmp, "store"),
               "trace_dir": os.environ.get("GRADCOLL_FAULT_TRACES")}
        pipes = [ctx.Pipe() for _ in range(size)]
        procs = [ctx.Process(target=rank_main, args=(cfg, r, pipes[r][1]), daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        for _, child in pipes:
            child.close()
        conns = {pipes[r][0]: r for r in range(size)}
        pids = [p.pid for p in procs if p.pid is not None]
        try:
            _drive(out, procs, conns, fault, victim, timeout, after)
        finally:
            if fault == "stop-mid" and procs[victim].is_alive():
                procs[victim].kill()  # a stopped process takes SIGKILL
            for r, p in enumerate(procs):
                p.join(10.0)
                if p.is_alive():
                    out.hung.append(r)
                    p.kill()
                    p.join(5.0)
                out.exitcodes[r] = p.exitcode
            for c in conns:
                c.close()
        out.leaked_segments = _segments(pids)
    return out


def _drive(out: Outcome, procs: list[Any], conns: dict[Any, int], fault: str, victim: int, timeout: float,
           after: int) -> None:
    size = len(procs)
    survivors = [r for r in range(size) if r != victim]
    victim_conn = next(c for c, r in conns.items() if r == victim)
    want_ready = fault in ("kill", "stall")
    ready = False
    deadline = time.monotonic() + STARTUP_S
    done: set[int] = set()
    live = dict(conns)

    def pump(until: float) -> None:
        nonlocal ready
        for c in multiprocessing.connection.wait(list(live), max(0.0, until - time.monotonic())):
            r = live[c]  # type: ignore[index]
            try:
                msg = c.recv()  # type: ignore[union-attr]
            except EOFError:
                del live[c]  # type: ignore[arg-type]
                done.add(r)
                continue
            kind = msg[0]
            if kind == "ready":
                ready = True
            elif kind == "entering":
                out.t_enter[r] = msg[2]
            elif kind == "killed":
                out.t_fault = msg[2]
            elif kind == "result":
                out.reports[r] = msg[2]
                done.add(r)
            elif kind == "boot-failed":
                out.notes.append(f"rank {r}: bootstrap failed: {msg[2]}")
                done.add(r)

    # 1. everyone in position: survivors about to call, the victim ready to die or stall
    while time.monotonic() < deadline and not (all(r in out.t_enter or r in done for r in survivors)
                                               and (ready or not want_ready)):
        if not live:
            break
        pump(deadline)
    if fault == "kill":
        try:
            os.kill(procs[victim].pid, signal.SIGKILL)
        except ProcessLookupError:
            out.notes.append(f"rank {victim} died before the kill (exit code {procs[victim].exitcode})")
        out.t_fault = time.monotonic()
    # 2. every survivor reports (it raised, or ran out of calls)
    deadline = time.monotonic() + after * (timeout + 6.0) + 10.0
    while time.monotonic() < deadline and not all(r in done for r in survivors) and live:
        pump(deadline)
    if fault == "stall":
        try:
            victim_conn.send("go")
        except OSError:
            pass


#: What every survivor must raise, by fault: the exception class, and the words naming the root cause.
ROOT = {"kill": ("TransportBroken", r"rank {v} died during (?P<op>[a-z -]+) \(seq (?P<seq>\d+)\), seen by rank \d"),
        "stall": ("CollectiveTimeout", r"rank\(s\) {v} stalled in (?P<op>[a-z -]+) \(seq (?P<seq>\d+)\)")}
ROOT["kill-mid"], ROOT["stop-mid"] = ROOT["kill"], ROOT["stall"]


def problems(out: Outcome) -> list[str]:
    """Everything that falls short of the contract; empty when the scenario passed.

    Every survivor raises within its timeout plus one second of the fault, and they all raise the same
    exception class naming the same root cause (the victim, the operation and the seq it failed in);
    the group is poisoned afterwards; nothing is lost or left behind.
    """
    bad: list[str] = list(out.notes)
    v = out.victim
    if out.hung:
        bad.append(f"ranks {out.hung} hung and were killed by the harness")
    if out.leaked_segments:
        bad.append(f"shared-memory segments left behind: {out.leaked_segments}")
    cls, pattern = ROOT[out.fault]
    named: dict[int, tuple[str, str]] = {}
    for r in out.survivors:
        rep = out.reports.get(r)
        if rep is None:
            bad.append(f"rank {r}: no report")
            continue
        if rep["wrong"]:
            bad.append(f"rank {r}: {rep['wrong']} allreduce results were wrong")
        if "exc" not in rep:
            bad.append(f"rank {r}: no error after {out.fault} of rank {v}")
            continue
        msg, det = rep["msg"], out.detection(r)
        limit = out.timeout + 1.0
        if det is None or det > limit:
            bad.append(f"rank {r}: raised {det:.3f}s after the fault (limit {limit}s): {rep['exc']}: {msg}"
                       if det is not None else f"rank {r}: no detection time")
        if rep["exc"] != cls:
            bad.append(f"rank {r}: {out.fault} of rank {v} gave {rep['exc']} (want {cls}): {msg}")
        if cls == "CollectiveTimeout" and rep["missing"] != [v]:
            bad.append(f"rank {r}: CollectiveTimeout.missing is {rep['missing']}, not [{v}]: {msg}")
        if cls == "TransportBroken" and rep["peer"] != v:
            bad.append(f"rank {r}: TransportBroken.peer is {rep['peer']}, not {v}: {msg}")
        m = re.search(pattern.format(v=v), msg)
        if m is None:
            bad.append(f"rank {r}: the error does not name the root cause (rank {v}): {rep['exc']}: {msg}")
        else:
            named[r] = (m["op"], m["seq"])
            want = OPS.get(out.algorithm)
            if want is not None and m["op"] != want or want is None and m["op"] not in OPS.values():
                bad.append(f"rank {r}: the error names the operation {m['op']!r}, not {want or 'an allreduce'}")
        if not rep["poisoned"]:
            bad.append(f"rank {r}: the group was not poisoned after the failure ({rep.get('after_poison')})")
        if rep["fds1"] > rep["fds0"]:
            bad.append(f"rank {r}: {rep['fds1'] - rep['fds0']} file descriptors more after close than before init")
    if len(set(named.values())) > 1:
        bad.append(f"the survivors name different calls: {named}")
    return bad


def log_fault(**record: Any) -> None:
    """Append one measurement record to ``GRADCOLL_FAULT_LOG`` (JSON lines), if it is set."""
    import json

    path = os.environ.get("GRADCOLL_FAULT_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
