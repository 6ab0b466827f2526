"""Stall warnings, and the control channel that lets a stalled rank ask its peers where they are.

A rank waiting in a collective knows directly only about the peers it is
receiving from. To say which ranks have *arrived*, each group built by
[`init_process_group`][gradcoll.group.rendezvous.init_process_group] gets a **control channel**:
one UDP socket per rank, bound to the transport's host, whose addresses every
rank learned through the bootstrap store. Nothing travels on it while all is
well. The group's **monitor** thread (one per group) serves it and watches the
running collective:

* Once a collective has run ``stall_warning_s`` (default 10 s), the monitor
  sends a ``QUERY`` (this rank's op, seq, size, time waited) to every peer.
  Each peer's monitor answers at once with a ``STATUS`` (idle or running, its
  seq and op, for how long, poisoned, shrinking): the answer comes from the
  monitor thread, so a rank busy computing or blocked elsewhere still
  answers. After the answers (at most about a second) the stalled rank logs,
  on logger ``"gradcoll"`` at WARNING, which ranks have arrived, which have
  not (and where they are), and which did not answer (dead or unreachable);
  the collective keeps waiting until its timeout.
* A rank that receives a QUERY for a collective it has not reached logs that
  it is the one being waited for. So every rank, stalled or late, logs.

Datagrams carry a random 8-byte group token (set by rank 0 at bootstrap), so
a stray one from another group is ignored. With the group's secret each
also carries a counter and an HMAC tag keyed for the token: a forged,
altered or replayed datagram is dropped and logged with its address
(``gradcoll.observe.control.open_control`` opens the channel). Without a control channel (a
group built directly on a transport) the warning gives this rank's own view
only. The channel is also how survivors agree on membership after a failure
([`gradcoll.group.shrink`][gradcoll.group.shrink]). UDP across hosts may be filtered or lossy: the
stall report then lists those peers under "no answer".
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from .. import _auth
from .trace import Recorder

__all__ = [
    "ControlChannel", "Diagnostics", "Monitor", "Watched", "IDLE", "RUNNING", "POISONED", "SHRINKING", "CLOSED",
]

log = logging.getLogger("gradcoll")

# Datagram: magic, version, kind, source rank, generation, group token, seq, seconds, bytes, state; then UTF-8 text.
_MSG = struct.Struct("<4sBBHI8sqdQB")
_MAGIC, _VERSION = b"GCCT", 1
QUERY, STATUS, PING, JOIN, DECIDE, ACK, WAKE, ALARM = 1, 2, 3, 4, 5, 6, 7, 8
IDLE, RUNNING, POISONED, SHRINKING, CLOSED = 0, 1, 2, 3, 4
_STATE_NAMES = {IDLE: "idle", RUNNING: "running", POISONED: "poisoned", SHRINKING: "shrinking", CLOSED: "closed"}

#: (state, seq, op name, bytes, seconds in that state) of one rank.
Status = tuple[int, int, str, int, float]


class ControlChannel:
    """One rank's UDP endpoint of a group's control channel (see the module docstring)."""

    def __init__(self, sock: socket.socket, rank: int, size: int, addrs: list[tuple[str, int]], token: bytes, *,
                 host: str, backend: str, options: dict[str, Any], generation: int = 0, key: bytes | None = None) -> None:
        self.sock, self.rank, self.size, self.addrs, self.token = sock, rank, size, addrs, token
        # With the group's secret every datagram carries a counter and an HMAC tag (keyed for this group's
        # token): a forged, altered or replayed one is dropped and logged with its address.
        self._tagger = None if key is None else _auth.Tagger(_auth.derive(key, b"gradcoll-control-v1", token))
        self._sent, self._last_seen = 0, [0] * size
        self.host, self.backend, self.options, self.generation = host, backend, dict(options), generation
        self.cv = threading.Condition()
        self.state_fn: Callable[[], Status] = lambda: (IDLE, 0, "", 0, 0.0)
        self.replies: dict[int, Status] = {}  # STATUS answers since the last query
        self.heard: dict[int, float] = {}  # peer -> monotonic time of its last datagram
        self.joined: set[int] = set()  # peers that called shrink()
        self.decision: tuple[int, list[int], str, int] | None = None  # leader, members (old ranks), store host, port
        self.acks: set[int] = set()
        self.alarms: dict[int, bytes] = {}  # rank -> the first error record it published (the witness channel)
        #: Called (from the monitor thread) with (rank, record) when a peer's record arrives, and again while a
        #: collective runs: the group stops its collective waiting for frames that will not come.
        self.wake: Callable[[int, bytes], object] | None = None
        self._late_logged: set[int] = set()
        self.closed = False

    # -- sending -------------------------------------------------------------
    def send(self, peer: int, kind: int, seq: int = -1, seconds: float = 0.0, nbytes: int = 0, state: int = 0,
             text: str = "", payload: bytes = b"") -> None:
        """Send one datagram to ``peer`` (best effort: errors are ignored); ``payload`` goes after ``text``."""
        data = _MSG.pack(_MAGIC, _VERSION, kind, self.rank, self.generation, self.token, seq, seconds, nbytes,
                         state) + text.encode()[:1024] + payload[:1024]
        if self._tagger is not None:
            with self.cv:
                self._sent += 1
                count = self._sent
            data += count.to_bytes(8, "little")
            data += self._tagger.tag(count, data)
        try:
            self.sock.sendto(data, self.addrs[peer])
        except OSError:
            pass

    # -- the witness channel of the error path (gradcoll.algorithms._witness) ------------------
    def publish(self, record: bytes) -> None:
        """Keep ``record`` as this rank's and send it to every peer (the first one a rank publishes counts)."""
        with self.cv:
            if self.rank in self.alarms:
                return
            self.alarms[self.rank] = bytes(record)
        for p in range(self.size):
            if p != self.rank:
                self.send(p, ALARM, payload=record)

    def records(self) -> dict[int, bytes]:
        """The first record each rank published (this one included)."""
        with self.cv:
            return dict(self.alarms)

    def wait_records(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a datagram (a record, or anything else)."""
        with self.cv:
            self.cv.wait(timeout)

    def foreign_alarm(self) -> tuple[int, bytes] | None:
        """The record of the lowest other rank that published one, if any."""
        with self.cv:
            others = sorted((r, b) for r, b in self.alarms.items() if r != self.rank)
        return others[0] if others else None

    def rewake(self) -> None:
        """Call ``wake`` with the other ranks' records, lowest rank first, until one stops something."""
        wake = self.wake
        if wake is None:
            return
        with self.cv:
            others = sorted((r, b) for r, b in self.alarms.items() if r != self.rank)
        for src, record in others:
            if wake(src, record):
                return

    def send_status(self, peer: int) -> None:
        """Answer ``peer`` with this rank's status."""
        st, seq, name, nbytes, secs = self.state_fn()
        self.send(peer, STATUS, seq, secs, nbytes, st, name)

    # -- receiving -----------------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Handle at most one datagram, waiting up to ``timeout`` seconds for it."""
        try:
            self.sock.settimeout(max(0.0, timeout))
            data, addr = self.sock.recvfrom(4096)
        except (TimeoutError, BlockingIOError, InterruptedError):
            return
        except OSError:
            time.sleep(min(timeout, 0.05))  # closed under us: the owner is stopping
            return
        self.handle(data, addr)

    def _authentic(self, data: bytes, src: int, addr: object) -> bytes | None:
        """``data`` without its counter and tag if they prove the secret and the counter is new, else None."""
        assert self._tagger is not None
        cut = len(data) - 8 - _auth.MAC_SIZE
        count = int.from_bytes(data[cut : cut + 8], "little") if cut >= _MSG.size else 0
        if cut < _MSG.size or not self._tagger.check(count, data[cut + 8 :], data[: cut + 8]):
            log.warning("rank %d: dropped a control datagram from %s: its tag does not prove the group's secret",
                        self.rank, addr)
            return None
        with self.cv:
            if count <= self._last_seen[src]:
                return None  # a replay, or a datagram overtaken by a later one
            self._last_seen[src] = count
        return data[:cut]

    def handle(self, data: bytes, addr: object = None) -> None:
        """Act on one datagram (answer, record, or log)."""
        if len(data) < _MSG.size:
            return
        magic, version, kind, src, _gen, token, seq, secs, nbytes, state = _MSG.unpack_from(data)
        if magic != _MAGIC or version != _VERSION or token != self.token or not 0 <= src < self.size:
            return
        if self._tagger is not None:
            checked = self._authentic(data, src, addr)
            if checked is None:
                return
            data = checked
        body = data[_MSG.size:]
        text = body.decode(errors="replace") if kind != ALARM else ""
        with self.cv:
            self.heard[src] = time.monotonic()
            if kind == ALARM and src != self.rank:
                self.alarms.setdefault(src, bytes(body))
            elif kind == STATUS:
                self.replies[src] = (state, seq, text, nbytes, secs)
            elif kind == JOIN:
                self.joined.add(src)
            elif kind == DECIDE and self.decision is None:
                try:
                    host, port, members = text.split(" ")
                    self.decision = (src, [int(m) for m in members.split(",")], host, int(port))
                except ValueError:  # a malformed decision is ignored; the leader resends
                    pass
            elif kind == ACK:
                self.acks.add(src)
            self.cv.notify_all()
        if kind == ALARM:
            self.rewake()
        if kind in (QUERY, PING):
            self.send_status(src)
        if kind == DECIDE and self.decision is not None and self.decision[0] == src:
            self.send(src, ACK)
        if kind == QUERY:
            self._maybe_log_late(src, seq, secs, nbytes, text)

    def _maybe_log_late(self, src: int, seq: int, secs: float, nbytes: int, name: str) -> None:
        """Log (once per seq) when ``src`` waits for a collective this rank has not reached."""
        st, myseq, myname, _, mysecs = self.state_fn()
        late = (st == IDLE and myseq <= seq) or (st == RUNNING and myseq < seq)
        if not late or seq in self._late_logged:
            return
        self._late_logged.add(seq)
        where = f"idle {mysecs:.1f}s, next seq {myseq}" if st == IDLE else f"in {myname} (seq {myseq}) for {mysecs:.1f}s"
        log.warning("rank %d: rank %d has waited %.1fs in %s (seq %d, %d bytes) for this rank, which has not "
                    "arrived (%s)", self.rank, src, secs, name, seq, nbytes, where)

    def query_all(self, seq: int, seconds: float, nbytes: int, name: str) -> None:
        """Forget earlier answers and ask every peer for its status (a stall report)."""
        with self.cv:
            self.replies.clear()
        for p in range(self.size):
            if p != self.rank:
                self.send(p, QUERY, seq, seconds, nbytes, RUNNING, name)

    def close(self) -> None:
        """Release the socket. Idempotent."""
        if not self.closed:
            self.closed = True
            self.sock.close()


class Watched(Protocol):
    """What the monitor reads of the group it watches: the next seq, closed, and the failure that poisoned it."""

    seq: int
    closed: bool
    poison: tuple[str, int, BaseException] | None


class Monitor:
    """The group's monitor thread: serves the control channel and warns about stalled collectives."""

    def __init__(self, group: Watched, rec: Recorder, control: ControlChannel | None, stall_s: float | None,
                 timeout: float) -> None:
        self._group = weakref.ref(group)  # the thread must not keep an abandoned group alive
        self.rank, self.size, self.timeout = rec.rank, rec.size, timeout
        self.rec, self.control, self.stall_s = rec, control, stall_s
        self._stop = threading.Event()
        self._warned: Any = None
        self._report: tuple[tuple[str, int, int, float, float], float, float] | None = None  # cur, waited, until
        if control is not None:
            control.state_fn = self.status
        self._thread = threading.Thread(target=self._run, name=f"gradcoll-monitor-rank{self.rank}", daemon=True)
        self._thread.start()

    def status(self) -> Status:
        """This rank's status, as the control channel reports it."""
        g = self._group()
        now = time.perf_counter()
        if g is None or g.closed:
            return (CLOSED, -1, "", 0, 0.0)
        if g.poison is not None:
            name, seq, _ = g.poison
            return (POISONED, seq, name, 0, 0.0)
        cur = self.rec.current
        if cur is not None:
            return (RUNNING, cur[1], cur[0], cur[2], now - cur[3])
        return (IDLE, g.seq, "", 0, now - self.rec.last_end)

    def stop(self) -> None:
        """Stop the thread (the control channel stays open). Idempotent."""
        self._stop.set()
        if self.control is not None and not self.control.closed:
            self.control.send(self.control.rank, WAKE)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.is_set() and self._group() is not None:
            wait = self._tick()
            if self.control is not None:
                self.control.poll(wait)
            else:
                self._stop.wait(wait)

    def _tick(self) -> float:
        """Warn about the running collective if it is due; return how long to sleep."""
        now, stall, cur = time.perf_counter(), self.stall_s, self.rec.current
        wait = 0.25 if self.control is not None else 1.0
        if stall and cur is not None and cur is not self._warned:
            due = cur[3] + stall
            if now >= due:
                self._warned = cur
                waited = now - cur[3]
                if self.control is None:
                    log.warning("%s; no control channel to ask the peers (a group built directly on a transport)",
                                self._head(cur, waited))
                else:
                    self.control.query_all(cur[1], waited, cur[2], cur[0])
                    self._report = (cur, waited, now + min(1.0, max(0.1, stall)))
            else:
                wait = min(wait, due - now)
        ctl = self.control
        if ctl is not None and cur is not None and ctl.wake is not None and ctl.foreign_alarm() is not None:
            # A peer failed while this rank is inside a collective: a receive it posted after the first
            # wake-up would wait for its timeout (gradcoll.algorithms._witness.wake). Until it stops.
            ctl.rewake()
            wait = min(wait, 0.02)
        if self._report is not None:
            cur0, waited, until = self._report
            ctl = self.control
            assert ctl is not None
            with ctl.cv:
                replies = dict(ctl.replies)
            if len(replies) >= self.size - 1 or now >= until:
                self._report = None
                log.warning("%s", self._message(cur0, waited, replies))
            else:
                wait = min(wait, 0.02)
        return wait

    def _head(self, cur: tuple[str, int, int, float, float], waited: float) -> str:
        name, seq, nbytes = cur[0], cur[1], cur[2]
        return f"rank {self.rank}: {name} (seq {seq}, {nbytes} bytes) has waited {waited:.1f}s"

    def _message(self, cur: tuple[str, int, int, float, float], waited: float, replies: dict[int, Status]) -> str:
        """``rank 0: ... has waited 10.0s: arrived: 0, 1; not arrived: 2 (idle ...); ...``."""
        name, seq = cur[0], cur[1]
        arrived, missing, silent = [], [], []
        for p in range(self.size):
            if p == self.rank:
                arrived.append(str(p))
                continue
            r = replies.get(p)
            if r is None:
                silent.append(str(p))
                continue
            st, pseq, pname, _, secs = r
            if st == RUNNING and pseq == seq:
                arrived.append(str(p) if pname == name else f"{p} (called {pname})")
            elif st in (IDLE, RUNNING) and pseq > seq:
                arrived.append(f"{p} (done)")
            elif st == IDLE:
                missing.append(f"{p} (idle {secs:.1f}s, next seq {pseq})")
            elif st == RUNNING:
                missing.append(f"{p} (in {pname} seq {pseq} for {secs:.1f}s)")
            else:
                missing.append(f"{p} ({_STATE_NAMES.get(st, '?')}{f' after {pname} seq {pseq}' if pname else ''})")
        parts = [f"arrived: {', '.join(arrived)}", f"not arrived: {', '.join(missing) or 'none'}"]
        if silent:
            parts.append(f"no answer (dead or unreachable): {', '.join(silent)}")
        return f"{self._head(cur, waited)}: {'; '.join(parts)}; still waiting (timeout {self.timeout}s)"


class Diagnostics:
    """What a ProcessGroup keeps for ``stats()``, traces and stall warnings, around the records ``rec``.

    ``control`` is closed with the group unless ``owns_control`` is False
    (the group's membership owns it: ``shrink()`` goes on using it after the
    group is closed).
    """

    def __init__(self, group: Watched, rec: Recorder, *, timeout: float, stall_warning_s: float | None,
                 trace: str | None, control: ControlChannel | None, owns_control: bool = True) -> None:
        self.rec = rec
        self.stall_s, self.trace, self.control, self._owns_control = stall_warning_s, trace, control, owns_control
        if trace is not None:
            self.rec.start_trace()
        self.monitor = (Monitor(group, rec, control, stall_warning_s, timeout) if stall_warning_s or control
                        else None)

    def close(self) -> None:
        """Stop the monitor, write the trace given at construction, close the control channel if it owns it."""
        if self.monitor is not None:
            self.monitor.stop()
        if self.trace is not None and self.rec.tracing:
            self.rec.stop_trace(self.trace)
        if self.control is not None and self._owns_control:
            self.control.close()
