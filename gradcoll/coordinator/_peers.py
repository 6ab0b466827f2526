"""The coordinator's side of one connection: a reader thread, an inbox, and where the next gradient lands.

Every accepted connection gets its own reader thread, so gradients from all
workers arrive at the same time and a slow socket never delays a fast one.
The reader decodes frames, drops heartbeats (any byte already counted as a
sign of life), and appends everything else to the peer's inbox under the
server's condition variable, which it notifies. Errors (end of stream, a
broken link, undecodable bytes) are stored in ``error`` for the server to
act on; the reader then waits to be retired or stopped and closes the socket
itself, so no other thread ever closes a socket that is being read.

``slot`` is armed by the server during a collect: the decoder's sink hands
the slot's row of the reduction buffer to a gradient vector of the expected
message, step, index and length, which then lands in place without a copy.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GradcollError, ProtocolError
from ..errors import TransportError as _GONE  # after these nothing can be sent to the peer any more
from ._conn import POLL_S, Conn
from .protocol import Extension, FrameDecoder, Heartbeat, Message

__all__ = ["Peer", "Slot", "JOIN_MAX_FRAME", "MAX_AHEAD"]

log = logging.getLogger("gradcoll.coordinator")

#: Frame cap before a connection has joined: a stranger cannot make us allocate much.
JOIN_MAX_FRAME = 64 * 1024
#: Messages a worker may send ahead of the coordinator before it counts as a protocol violation.
MAX_AHEAD = 256


@dataclass
class Slot:
    """Where the gradient of one expected message may land (one row of the reduction buffer)."""

    cls: type
    step: int
    idx_field: str | None
    idx: int | None
    row: np.ndarray
    taken: bool = False

    def fits(self, cls: type, vals: dict[str, Any], count: int) -> bool:
        """True if a vector of ``count`` elements in a ``cls`` message with fields ``vals`` is the one expected."""
        return (not self.taken and cls is self.cls and count == self.row.size and vals.get("step") == self.step
                and (self.idx_field is None or vals.get(self.idx_field) == self.idx))


class Peer:
    """One connection accepted by the coordinator (joining, or a joined worker)."""

    def __init__(self, sock: Any, addr: Any, cond: threading.Condition) -> None:
        self.addr = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        self.cond = cond
        self.conn = Conn(sock, f"connection from {self.addr}", FrameDecoder(JOIN_MAX_FRAME, sink=self._sink))
        self.worker_id: int | None = None
        self.node_id = "?"
        self.gpu_count = 0
        self.backend = ""
        self.ext: Extension | None = None  # set when the peer is a gradcoll worker
        self.state = "joining"  # -> "auth" -> "joined"
        self.join_by = time.monotonic()
        self.server_nonce = b""
        self.inbox: collections.deque[Message] = collections.deque()
        self.error: GradcollError | None = None
        self.slot: Slot | None = None
        self.retired = False
        self._linger_until = 0.0
        self._wake = threading.Event()  # set by retire() or stop()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"gradcoll-coordinator-{self.addr}")

    @property
    def label(self) -> str:
        """How errors and logs name this peer: ``worker 1 (node host-42)``."""
        if self.worker_id is None:
            node = f" (node {self.node_id})" if self.node_id != "?" else ""
            return f"connection from {self.addr}{node}"
        return f"worker {self.worker_id} (node {self.node_id})"

    @property
    def gradcoll(self) -> bool:
        """True if the peer announced gradcoll's extensions (heartbeats, Abort, auth)."""
        return self.ext is not None

    @property
    def alive(self) -> bool:
        """True while frames can still be sent to the peer."""
        return not self.retired and self.conn.broken is None and not isinstance(self.error, _GONE)

    def joined(self, worker_id: int, max_frame_bytes: int) -> None:
        """Make this connection worker ``worker_id``; from now on frames up to ``max_frame_bytes`` are read."""
        self.worker_id = worker_id
        self.state = "joined"
        self.conn.name = self.label
        self.conn.decoder.max_frame_bytes = max_frame_bytes

    def start(self) -> None:
        """Start the reader thread."""
        self.thread.start()

    def retire(self, linger: float) -> None:
        """Stop sending (FIN after what is queued); the reader drains until the peer closes, at most ``linger`` s."""
        if self.retired:
            return
        self.retired = True
        self.conn.shutdown_write()
        self._linger_until = time.monotonic() + linger
        self._wake.set()

    def stop(self) -> None:
        """Stop the reader now; it closes the socket."""
        self._stop.set()
        self._wake.set()

    # -- reader thread ---------------------------------------------------------
    def _sink(self, cls: type, vals: dict[str, Any], count: int) -> np.ndarray | None:
        with self.cond:
            slot = self.slot
            if slot is None or not slot.fits(cls, vals, count):
                return None
            slot.taken = True
            return slot.row

    def _run(self) -> None:
        try:
            while not self._wake.is_set() and self.error is None:
                try:
                    msgs = self.conn.recv_messages()
                except GradcollError as e:
                    self._set_error(e)
                    break
                if msgs:
                    self._deliver(msgs)
            # After an error the socket stays open until the server has said why (Abort) and retired us.
            while not self._wake.wait(POLL_S):
                pass
            if self.retired and not self._stop.is_set() and not isinstance(self.error, _GONE):
                # Read until the peer closes: unread input would make our close send a reset,
                # which can destroy the Abort we just sent before the peer reads it.
                while time.monotonic() < self._linger_until and not self._stop.is_set():
                    if not self.conn.discard_some():
                        break
        finally:
            self.conn.close()

    def _deliver(self, msgs: list[Message]) -> None:
        with self.cond:
            for m in msgs:
                if isinstance(m, Heartbeat):
                    continue
                if len(self.inbox) >= MAX_AHEAD:
                    self.error = ProtocolError(f"{self.label} sent more than {MAX_AHEAD} messages ahead of the "
                                               "coordinator")
                    break
                self.inbox.append(m)
            self.cond.notify_all()

    def _set_error(self, e: GradcollError) -> None:
        with self.cond:
            if self.error is None:
                self.error = e
            self.cond.notify_all()
        if self.state != "joined":
            log.debug("%s: %s", self.label, e)

