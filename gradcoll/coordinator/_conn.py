"""One framed TCP connection of the coordinator protocol: deadline-bounded, locked I/O and nothing else.

The socket keeps a short timeout (``POLL_S``) so no call ever blocks for
long: receive calls return ``[]`` when nothing came in that slice (the caller
checks its own deadline and the peer's heartbeat), and a send loops on
partial ``sendmsg`` results until its deadline. Frames go out as the
buffers of ``encode_parts`` (the gradient
is never copied) under one send lock, so a heartbeat thread never cuts into
a frame. A send that stops half-way leaves the stream unusable: the
connection is then marked broken and every later send raises.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from .._util import Deadline
from ..errors import CollectiveTimeout, GradcollError, TransportBroken, TransportClosed
from ..transport.tcp_connect import congestion, set_congestion
from .protocol import FrameDecoder, Message, encode_parts

__all__ = ["Conn", "POLL_S", "SOCKBUF", "tune", "dial_once", "congestion", "set_congestion"]

POLL_S = 0.1  # longest a single socket call blocks; bounds how late a deadline or a stop is noticed
SOCKBUF = 4 << 20


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY (small control frames must not wait for Nagle) and large buffers for gradients."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKBUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)
    except OSError:
        pass


def dial_once(host: str, port: int, timeout: float) -> socket.socket:
    """One attempt to connect to ``host:port`` (each of its addresses in turn), the link's congestion control set
    before it connects (reno on one host: ``gradcoll.transport.tcp_connect.congestion``); raises the last
    ``OSError``."""
    last: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            set_congestion(sock, congestion(str(addr[0])))
            sock.settimeout(timeout)
            sock.connect(addr)
            return sock
        except OSError as e:
            sock.close()
            last = e
        except BaseException:
            sock.close()
            raise
    raise last


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0
    return views


class Conn:
    """A connected socket speaking protocol frames; ``name`` is how errors refer to the peer."""

    def __init__(self, sock: socket.socket, name: str, decoder: FrameDecoder) -> None:
        tune(sock)
        sock.settimeout(POLL_S)
        self.sock = sock
        self.name = name
        self.decoder = decoder
        self.last_rx = time.monotonic()  # any byte counts as a sign of life, not only heartbeats
        self.broken: GradcollError | None = None
        self.closed = False
        self._send_lock = threading.Lock()
        self._scratch = bytearray(1 << 16)

    # -- sending ------------------------------------------------------------
    def send(self, msg: Message, timeout: float, max_frame_bytes: int | None) -> None:
        """Send one message within ``timeout`` seconds (UsageError, before sending, if it is too large)."""
        self.send_parts(encode_parts(msg, max_frame_bytes), timeout)

    def try_send(self, msg: Message, timeout: float) -> bool:
        """Send ``msg`` unless another frame is being sent right now (then the peer sees bytes anyway)."""
        return self.send_parts(encode_parts(msg, None), timeout, wait_lock=False)

    def send_parts(self, parts: list[Any], timeout: float, *, wait_lock: bool = True) -> bool:
        """Send one frame given as buffers; returns False only if ``wait_lock`` is False and the lock was busy."""
        deadline = Deadline(timeout)
        if not self._send_lock.acquire(timeout=timeout if wait_lock else 0):
            if not wait_lock:
                return False
            raise CollectiveTimeout(f"sending to {self.name}: another send held the link for {timeout}s")
        try:
            if self.broken is not None:
                raise TransportBroken(f"the link to {self.name} is unusable: {self.broken}")
            if self.closed:
                raise TransportClosed(f"the connection to {self.name} is closed")
            views = [memoryview(p).cast("B") for p in parts]
            started = False
            try:
                while views:
                    try:
                        n = self.sock.sendmsg(views)
                    except TimeoutError:
                        n = 0
                    if n:
                        started = True
                        views = _advance(views, n)
                    elif deadline.expired():
                        raise CollectiveTimeout(f"sending to {self.name} timed out after {timeout}s "
                                                "(the peer stopped reading)")
            except GradcollError:  # our own timeout (a TimeoutError, hence an OSError: caught first)
                if started:  # half a frame is on the wire: the stream cannot be resumed
                    self.broken = TransportBroken(f"a frame to {self.name} was cut short by a send timeout")
                raise
            except OSError as e:
                self.broken = TransportBroken(f"sending to {self.name} failed: {e.strerror or e}")
                raise self.broken from e
            except BaseException as e:
                if started:  # e.g. KeyboardInterrupt: the same, half a frame is on the wire
                    self.broken = TransportBroken(f"a frame to {self.name} was cut short ({type(e).__name__})")
                raise
            return True
        finally:
            self._send_lock.release()

    # -- receiving ----------------------------------------------------------
    def recv_messages(self) -> list[Message]:
        """Read what arrives within POLL_S and decode it; ``[]`` if nothing did.

        Raises TransportBroken when the peer closed or the link broke, and
        ProtocolError when the bytes do not decode.
        """
        try:
            n = self.sock.recv_into(self.decoder.get_buffer())
        except TimeoutError:
            return []
        except OSError as e:
            raise TransportBroken(f"the link to {self.name} broke: {e.strerror or e}") from e
        if n == 0:
            cut = " in the middle of a frame" if self.decoder.in_frame else ""
            raise TransportBroken(f"{self.name} closed the connection{cut}")
        self.last_rx = time.monotonic()
        return self.decoder.buffer_updated(n)

    def discard_some(self) -> bool:
        """Read and drop what arrives within POLL_S; False at end of stream or on error."""
        try:
            return self.sock.recv_into(self._scratch) > 0
        except TimeoutError:
            return True
        except OSError:
            return False

    # -- closing ------------------------------------------------------------
    def shutdown_write(self) -> None:
        """Send FIN after what is queued; the peer reads everything we sent, then end of stream."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """Close the socket (idempotent). Call it from the thread that receives, once it stopped receiving."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a sender blocked on this socket
        except OSError:
            pass
        # Close under the send lock: a thread still inside sendmsg must not find
        # the descriptor number reused by another socket.
        locked = self._send_lock.acquire(timeout=POLL_S * 20)
        try:
            self.sock.close()
        finally:
            if locked:
                self._send_lock.release()
