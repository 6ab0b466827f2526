"""How the tcp transport finds a peer that fell silent: keepalive probes and a user timeout on every link.

A pulled cable, a host that lost power or a partition sends no FIN and no
RST: without help a socket would wait on such a peer for as long as the
kernel retransmits (minutes). ``set_liveness`` has the kernel probe an idle
link every ``heartbeat_s`` seconds (TCP keepalive) and drop a link whose
probes or data stay unanswered for ``link_timeout`` seconds
(``TCP_USER_TIMEOUT``); the transport then fails the link's operations with
``unreachable_or_broken``'s reason. The kernel answers the probes, so a peer
busy computing (or stopped in a debugger) is never taken for dead.
"""

from __future__ import annotations

import errno
import math
import socket

__all__ = ["HEARTBEAT_S", "LINK_TIMEOUT_S", "set_liveness", "unreachable_or_broken"]

#: Default seconds between keepalive probes of an idle link (and of silence before the first).
HEARTBEAT_S = 5.0
#: Default seconds a link may go unanswered (probes or data) before it is dropped as unreachable.
LINK_TIMEOUT_S = 30.0
#: Errors of a link whose peer stopped answering (keepalive or user timeout, no route): the peer is unreachable.
_SILENT = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


def set_liveness(sock: socket.socket, heartbeat_s: float = HEARTBEAT_S, link_timeout: float = LINK_TIMEOUT_S) -> None:
    """Probe ``sock`` when idle every ``heartbeat_s``; drop it after ``link_timeout`` s without an answer (Linux).

    Keepalive probes find a silent peer on an idle link; ``TCP_USER_TIMEOUT``
    bounds how long sent data (or probes) may stay unacknowledged. Where the
    options do not exist (or ``sock`` is not a TCP socket), only the
    collectives' timeouts apply.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    beat = max(1, int(round(heartbeat_s)))  # the kernel counts whole seconds
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", beat), ("TCP_KEEPINTVL", beat),
                        ("TCP_KEEPCNT", max(1, math.ceil(link_timeout / beat)))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(link_timeout * 1000)))


def unreachable_or_broken(peer: int, e: OSError, link_timeout: float, heartbeat_s: float) -> str:
    """The reason the link to ``peer`` failed with ``e``: unreachable (silence) or broken."""
    if e.errno in _SILENT:
        return (f"peer {peer} is unreachable: the link gave no sign of life for {link_timeout:g}s "
                f"(probed every {heartbeat_s:g}s; {e.strerror or e})")
    return f"link broke ({e.strerror or e})"
