"""Coordinator fault scenarios: a GradientServer in this process, every peer a forkserver child.

Good peers are WorkerClients that send one gradient for step 0 and report
what came back. The culprit (:data:`STEP_FAULTS` while a step runs,
:data:`JOIN_FAULTS` while the coordinator waits for workers) misbehaves as
its role says; raw culprits write protocol bytes by hand. Every child talks
to the parent over a pipe; times are ``time.monotonic()`` (one clock per host).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

N = 64  # gradient elements
#: Faults injected by a joined worker while the coordinator collects step 0.
STEP_FAULTS = ("kill", "silent", "wrong-step", "wrong-length", "nan", "half-frame", "half-frame-close",
               "oversized", "garbage")
#: Faults injected by a stranger while the coordinator waits for workers.
JOIN_FAULTS = ("stranger-random", "stranger-idle", "no-secret", "wrong-secret", "forged-mac")
SECRET = "s3cr3t-for-tests"
MAX_FRAME = 1 << 20


def _raw_join(addr: tuple[str, int], timeout: float) -> tuple[socket.socket, int]:
    from gradcoll.coordinator.protocol import FrameDecoder, JoinAccepted, JoinRequest, encode

    s = socket.create_connection(addr, timeout=timeout)
    s.sendall(encode(JoinRequest("raw-culprit", 1, "cpu")))
    dec, msgs = FrameDecoder(), []
    while not msgs:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("closed during the join")
        msgs = dec.feed(chunk)
    assert isinstance(msgs[0], JoinAccepted), msgs[0]
    return s, msgs[0].worker_id


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def peer_main(addr: tuple[str, int], role: str, conn: Any, timeout: float) -> None:
    """One peer process: ``role`` is "good" or a fault name."""
    from gradcoll.coordinator import DistributedConfig, WorkerClient
    from gradcoll.coordinator.protocol import LENGTH, GradientPayload, encode

    def report(kind: str, *rest: Any) -> None:
        conn.send((kind, time.monotonic(), *rest))

    try:
        if role in JOIN_FAULTS:
            _stranger(addr, role, report, conn, timeout)
            return
        raw = role in ("half-frame", "half-frame-close", "oversized", "garbage")
        if raw:
            s, wid = _raw_join(addr, timeout)
            report("joined", wid)
            if role == "oversized":
                s.sendall(LENGTH.pack(MAX_FRAME + 1) + b"\x04" + b"\0" * 64)
            elif role == "garbage":
                s.sendall(os.urandom(256))
            else:
                frame = encode(GradientPayload(0, wid, np.ones(N, np.float32), 0.0, 1, 2))
                s.sendall(frame[: len(frame) // 2])
                if role == "half-frame-close":
                    s.close()
            report("fault")
            if role != "half-frame-close":
                conn.recv()  # idle until released
                s.close()
            return
        secret = SECRET if role == "good-secret" else None
        cfg = DistributedConfig.worker(addr, timeout_s=timeout + 5.0, secret=secret)
        with WorkerClient.connect(cfg, 1, "cpu") as c:
            wid = c.worker_id()
            report("joined", wid)
            if role in ("kill", "silent"):
                conn.recv()  # "kill": SIGKILLed here; "silent": released after the test
                return
            g = np.full(N, wid + 1.0, np.float32)
            step = 0
            if role == "wrong-step":
                step = 1
            elif role == "wrong-length":
                g = np.ones(N + 1, np.float32)
            elif role == "nan":
                g[5] = np.nan
            c.send_gradients(step, g, 0.5, 1, 2)
            report("fault" if role != "good" and role != "good-secret" else "sent")
            try:
                res = c.receive_averaged()
                report("result", wid, res.gradients.tolist())
            except Exception as e:  # noqa: BLE001 - the coordinator's word is the point
                report("error", wid, type(e).__name__, str(e))
    except BaseException as e:  # noqa: BLE001
        report("crashed", f"{type(e).__name__}: {e}")


def _stranger(addr: tuple[str, int], role: str, report: Any, conn: Any, timeout: float) -> None:
    from gradcoll.coordinator import DistributedConfig, WorkerClient
    from gradcoll.coordinator.protocol import AuthChallenge, AuthResponse, Extension, FrameDecoder, JoinRequest, encode
    from gradcoll.errors import GradcollError

    if role in ("no-secret", "wrong-secret"):
        cfg = DistributedConfig.worker(addr, timeout_s=timeout + 5.0, secret=None if role == "no-secret" else "nope")
        report("fault")
        try:
            with WorkerClient.connect(cfg, 1, "cpu") as c:
                report("admitted", c.worker_id())
        except GradcollError as e:
            report("refused", type(e).__name__, str(e))
        return
    s = socket.create_connection(addr, timeout=timeout + 5.0)
    if role == "stranger-random":
        s.sendall(os.urandom(1 + int.from_bytes(os.urandom(1), "big")))
    elif role == "forged-mac":
        s.sendall(encode(JoinRequest("forger", 1, "cpu", Extension(flags=1, nonce=os.urandom(16)))))
        dec, msgs = FrameDecoder(), []
        while not msgs:
            chunk = s.recv(4096)
            if not chunk:
                break
            msgs = dec.feed(chunk)
        if msgs and isinstance(msgs[0], AuthChallenge):
            s.sendall(encode(AuthResponse(os.urandom(32))))
    report("fault")
    conn.recv()  # the test has finished its step: did the coordinator close on us?
    report("refused" if _closed_by_peer(s, 0.5) else "still-open")
    s.close()


@dataclass
class CoordOutcome:
    """What one coordinator scenario produced."""

    fault: str
    culprit: int | None = None
    t_fault: float | None = None
    server_exc: BaseException | None = None
    t_server_exc: float | None = None
    t_collect: float | None = None
    result: Any = None
    peers: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    poisoned: bool = False
    hung: list[str] = field(default_factory=list)

    def detection(self) -> float | None:
        """Seconds from the fault to the coordinator's exception."""
        if self.t_server_exc is None:
            return None
        start = self.t_fault if self.t_fault is not None else self.t_collect
        return None if start is None else self.t_server_exc - start


def serve_in_thread(body: Any) -> threading.Thread:
    """Run ``body()`` in a daemon thread."""
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def run_coord_fault(fault: str, timeout: float = 1.0) -> CoordOutcome:
    """Run one scenario (a STEP_FAULTS or JOIN_FAULTS name) and return what happened."""
    import multiprocessing.connection
    import signal

    from gradcoll.coordinator import DistributedConfig, GradientServer
    from gradcoll.errors import GroupPoisoned
    from tests.faults._harness import STARTUP_S, context

    ctx = context()
    joining = fault in JOIN_FAULTS
    secret = SECRET if fault in ("no-secret", "wrong-secret", "forged-mac") else None
    cfg = DistributedConfig.coordinator("127.0.0.1:0", 2 if joining else 3, timeout_s=timeout if not joining else 30.0,
                                        max_frame_bytes=MAX_FRAME, secret=secret)
    out = CoordOutcome(fault)
    good = "good-secret" if secret else "good"
    with GradientServer.bind(cfg) as srv:
        addr = srv.local_addr()
        conns: dict[Any, str] = {}
        procs: dict[str, Any] = {}

        def start(name: str, role: str) -> None:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=peer_main, args=(addr, role, child, timeout), daemon=True)
            p.start()
            child.close()
            conns[parent] = name
            procs[name] = p

        def server() -> None:
            try:
                srv.wait_for_workers()
                out.t_collect = time.monotonic()
                res = srv.collect_and_reduce(0)
                srv.broadcast_averaged(0, res)
                out.result = res.avg_gradients.tolist()
            except BaseException as e:  # noqa: BLE001 - judged by the test
                out.t_server_exc, out.server_exc = time.monotonic(), e
                try:
                    srv.collect_and_reduce(1)
                except GroupPoisoned:
                    out.poisoned = True
                except BaseException:  # noqa: BLE001
                    pass

        def pump(until: float, stop: Any) -> None:
            while conns and not stop() and time.monotonic() < until:
                for c in multiprocessing.connection.wait(list(conns), max(0.0, min(0.2, until - time.monotonic()))):
                    name = conns[c]  # type: ignore[index]
                    try:
                        msg = c.recv()  # type: ignore[union-attr]
                    except EOFError:
                        del conns[c]  # type: ignore[arg-type]
                        continue
                    out.peers.setdefault(name, []).append(msg)
                    if name == "culprit" and msg[0] == "joined":
                        out.culprit = msg[2]
                    if name == "culprit" and msg[0] == "fault":
                        out.t_fault = msg[1]

        def seen(name: str, kind: str) -> bool:
            return any(m[0] == kind for m in out.peers.get(name, []))

        th = serve_in_thread(server)
        if joining:  # the stranger first, so the coordinator meets it while it waits for workers
            start("culprit", fault)
            pump(time.monotonic() + STARTUP_S, lambda: seen("culprit", "fault"))
            start("good0", good)
            start("good1", good)
        else:
            start("good0", good)
            start("good1", good)
            start("culprit", fault)
        pump(time.monotonic() + STARTUP_S,
             lambda: all(seen(n, "sent") for n in ("good0", "good1")) and (joining or seen("culprit", "joined")))
        if fault == "kill":
            os.kill(procs["culprit"].pid, signal.SIGKILL)
            out.t_fault = time.monotonic()
        th.join(3 * timeout + 30.0)
        if th.is_alive():
            out.hung.append("coordinator")
        pump(time.monotonic() + timeout + 10.0,
             lambda: all(seen(n, "result") or seen(n, "error") for n in ("good0", "good1")))
        for c, name in list(conns.items()):
            if name == "culprit":
                try:
                    c.send("go")
                except OSError:
                    pass
        pump(time.monotonic() + 10.0, lambda: not joining or any(
            seen("culprit", k) for k in ("refused", "still-open", "admitted")))
        for name, p in procs.items():
            p.join(10.0)
            if p.is_alive():
                out.hung.append(name)
                p.kill()
                p.join(5.0)
        for c in conns:
            c.close()
    return out


def coord_problems(out: CoordOutcome, timeout: float) -> list[str]:
    """What falls short of the contract in ``out``; empty when it passed."""
    bad = [f"{h} hung" for h in out.hung]
    for name, msgs in out.peers.items():
        bad += [f"{name} crashed: {m[2]}" for m in msgs if m[0] == "crashed"]
    if out.fault in JOIN_FAULTS:
        if out.server_exc is not None:
            bad.append(f"the coordinator failed instead of serving the legitimate workers: {out.server_exc!r}")
        if out.result != [1.5] * N:
            bad.append(f"the step's average is wrong or missing: {str(out.result)[:80]}")
        for n in ("good0", "good1"):
            got = [m for m in out.peers.get(n, []) if m[0] in ("result", "error")]
            if not got or got[0][0] != "result" or got[0][3] != [1.5] * N:
                bad.append(f"{n} did not get the right average: {got[:1]}")
        verdicts = [m[0] for m in out.peers.get("culprit", []) if m[0] in ("refused", "still-open", "admitted")]
        if verdicts != ["refused"]:
            bad.append(f"the stranger was not refused: {verdicts}")
        return bad
    exc, wid = out.server_exc, out.culprit
    if exc is None:
        return bad + ["the coordinator did not fail"]
    if wid is None or f"worker {wid}" not in str(exc):
        bad.append(f"the coordinator's error does not name worker {wid}: {exc!r}")
    det = out.detection()
    if det is None or det > timeout + 1.0:
        bad.append(f"detected after {det}s (limit {timeout + 1.0}s)")
    if not out.poisoned:
        bad.append("the coordinator was not poisoned")
    for n in ("good0", "good1"):
        got = [m for m in out.peers.get(n, []) if m[0] in ("result", "error")]
        if not got or got[0][0] != "error":
            bad.append(f"{n} was not told: {got[:1]}")
        elif f"worker {wid}" not in got[0][4]:
            bad.append(f"{n}'s error does not name worker {wid}: {got[0][3]}: {got[0][4]}")
    return bad
