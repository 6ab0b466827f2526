"""The TCP transport's bootstrap: listen, dial, accept and the HELLO handshake.

Every rank that has higher peers listens and publishes ``host port token``
in the store; every rank dials each lower rank, so each pair gets exactly
one connection. A 32-byte handshake (magic, version, rank, world size, the
listener's random token; ``gradcoll.transport.frame``) refuses strangers,
stale addresses and duplicate links. ``connect`` returns the connected
sockets; ``gradcoll.transport.tcp`` runs its data path over them.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time

from .._util import Deadline, recv_exact
from ..errors import CollectiveTimeout, ProtocolError, UsageError
from ..store import Store
from . import frame as fr

__all__ = ["connect", "SOCKBUF", "HANDSHAKE_TIMEOUT"]

log = logging.getLogger("gradcoll.transport.tcp")  # the transport's logger, as before the split

#: Default SO_SNDBUF/SO_RCVBUF of every link.
SOCKBUF = 4 << 20
#: Seconds one connection may take to complete the handshake.
HANDSHAKE_TIMEOUT = 5.0


def connect(store: Store, rank: int, size: int, deadline: Deadline, *, host: str = "127.0.0.1",
            sockbuf: int = SOCKBUF, key_prefix: str = "tcp") -> dict[int, socket.socket]:
    """One connected, authenticated, ``TCP_NODELAY`` socket to every other rank (peer -> socket).

    Listens on ``host`` (an ephemeral port) when this rank has higher peers
    and publishes the address under ``{key_prefix}/{rank}``; dials every lower
    rank and accepts every higher one, all before ``deadline``.
    """
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} out of range for world size {size}")
    socks: dict[int, socket.socket] = {}
    listener = None
    try:
        if rank < size - 1:
            listener = socket.socket(_family(host), socket.SOCK_STREAM)
            _tune(listener, sockbuf)  # accepted sockets inherit the buffer sizes
            listener.bind((host, 0))
            listener.listen(size)
            token = secrets.token_bytes(16)
            port = listener.getsockname()[1]
            store.set(f"{key_prefix}/{rank}", f"{host} {port} {token.hex()}".encode())
        for peer in range(rank):
            socks[peer] = _dial(store, f"{key_prefix}/{peer}", rank, size, peer, deadline, sockbuf)
        if listener is not None:
            socks.update(_accept_all(listener, token, rank, size, deadline))
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        if listener is not None:
            listener.close()
    for s in socks.values():
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket, sockbuf: int) -> None:
    if sockbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)


def _dial(store: Store, key: str, rank: int, size: int, peer: int, deadline: Deadline, sockbuf: int) -> socket.socket:
    """Connect to ``peer``'s listener and complete the handshake, retrying until the deadline."""
    delay, last = 0.005, None
    while True:
        left = deadline.remaining()
        host, port, token_hex = store.get(key, left).decode().split()
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            _tune(sock, sockbuf)
            sock.settimeout(min(HANDSHAKE_TIMEOUT, left) if left is not None else HANDSHAKE_TIMEOUT)
            sock.connect((host, int(port)))
            token = bytes.fromhex(token_hex)
            sock.sendall(fr.pack_hello(fr.HELLO, rank, size, token))
            ack = fr.unpack_hello(recv_exact(sock, fr.HELLO_SIZE, "handshake"))
            if ack.kind != fr.ACK or ack.rank != peer or ack.size != size or ack.token != token:
                raise ProtocolError(f"unexpected handshake answer {ack}")
            sock.settimeout(None)
            return sock
        except (OSError, ProtocolError) as e:  # refused, stale address, stranger: retry
            sock.close()
            last = e
        if deadline.expired():
            raise CollectiveTimeout(
                f"rank {rank}: could not connect to peer {peer} at {host}:{port} within "
                f"{deadline.timeout}s (tcp transport; last error: {last})",
                rank=rank, missing=[peer], op="tcp connect",
            )
        time.sleep(min(delay, deadline.remaining() or delay))  # back off between connect attempts
        delay = min(delay * 2, 0.2)


def _accept_all(
    listener: socket.socket, token: bytes, rank: int, size: int, deadline: Deadline
) -> dict[int, socket.socket]:
    """Accept one authenticated connection from every higher rank; refuse anything else."""
    pending, socks = set(range(rank + 1, size)), {}
    while pending:
        left = deadline.remaining()
        if left == 0:
            raise CollectiveTimeout(
                f"rank {rank}: peers {sorted(pending)} did not connect within {deadline.timeout}s (tcp transport)",
                rank=rank, missing=sorted(pending), op="tcp accept",
            )
        listener.settimeout(left)
        try:
            conn, addr = listener.accept()
        except TimeoutError:
            continue
        try:
            conn.settimeout(min(HANDSHAKE_TIMEOUT, left) if left is not None else HANDSHAKE_TIMEOUT)
            hello = fr.unpack_hello(recv_exact(conn, fr.HELLO_SIZE, "handshake"))
            if hello.kind != fr.HELLO or hello.token != token or hello.size != size or hello.rank not in pending:
                raise ProtocolError(f"unexpected handshake {hello} (expecting one of ranks {sorted(pending)})")
            conn.sendall(fr.pack_hello(fr.ACK, rank, size, token))
            conn.settimeout(None)
        except (OSError, ProtocolError) as e:
            log.warning("rank %d: refused a connection from %s: %s", rank, addr, e)
            conn.close()
            continue
        pending.discard(hello.rank)
        socks[hello.rank] = conn
    return socks
