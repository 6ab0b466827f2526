"""The TCP transport's bootstrap: listen, dial, accept and the HELLO handshake.

Every rank that has higher peers listens and publishes ``host port token``
in the store; every rank dials each lower rank, so each pair gets exactly
one connection. A 32-byte handshake (magic, version, rank, world size, the
listener's random token; ``gradcoll.transport.frame``) refuses strangers,
stale addresses and duplicate links. ``connect`` returns the connected
sockets; ``gradcoll.transport.tcp`` runs its data path over them.

A listener runs every handshake in parallel, each in a thread of its own
with a deadline (``HANDSHAKE_TIMEOUT``): idle or slow strangers cost their
own thread, never a legitimate rank's seat, and a rank is counted only once
its handshake completed on a live socket. A second completed handshake for
a rank already connected is refused and logged with both addresses.

With a ``key`` (the group's shared secret) the handshake is mutual
challenge-response (``HELLO_AUTH``/``ACK_AUTH``): the dialler sends its
nonce after the HELLO; the listener answers with its nonce and its proof;
the dialler answers with its proof. Each proof is an HMAC
(``gradcoll._auth``) bound to the listener's token (the group's session
for that listener), both rank numbers, both nonces and the port dialled,
so a recorded handshake cannot be replayed and a live one cannot be relayed
through another address. A peer without the secret is refused and logged
with its address; a dialler refuses a listener that cannot prove it. The
same fields give each direction of the link its own key for the data
frames' integrity tags (``frame_key``; ``gradcoll.transport.tcp_secure``).

With an ``ssl_context`` pair (server side, client side) every connection is
wrapped in TLS right after the TCP connect, before the HELLO, so the
handshake and every frame after it run inside TLS. A TLS failure (a
certificate the other side does not trust) is final, never retried: the
dialler raises a ``ProtocolError`` naming the peer at once, and the
listener refuses and logs the connection.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from typing import NamedTuple

from .. import _auth
from .._util import Deadline, recv_exact
from ..errors import CollectiveTimeout, ProtocolError, UsageError
from ..store import Store
from . import frame as fr

__all__ = ["connect", "Linked", "frame_key", "SOCKBUF", "HANDSHAKE_TIMEOUT", "LOCAL_CONGESTION", "congestion",
           "set_congestion"]

log = logging.getLogger("gradcoll.transport.tcp")  # the transport's logger, as before the split

#: Default SO_SNDBUF/SO_RCVBUF of every link.
SOCKBUF = 4 << 20
#: The congestion control of a link whose two ends are on one host (a loopback address, or the same address at
#: both ends). A pacing one, such as BBR where it is the system's default, sends each burst from a timer: on a
#: link with no network under it that only costs, and a large allreduce is markedly slower with BBR than with
#: reno or cubic (docs/transports.md, "Congestion control"). Reno is in every
#: kernel's list of those a process may choose. ``GRADCOLL_TCP_CONGESTION`` names another, for every link.
LOCAL_CONGESTION = "reno"
#: Seconds one connection may take to complete the handshake.
HANDSHAKE_TIMEOUT = 5.0
#: (server side, client side) TLS contexts, or None for plain TCP.
TlsPair = tuple[ssl.SSLContext, ssl.SSLContext] | None


class Linked(NamedTuple):
    """One connected link: its socket and, with a secret, the keys of its two directions' integrity tags."""

    sock: socket.socket
    send_key: bytes | None = None
    recv_key: bytes | None = None


def frame_key(secret: bytes, token: bytes, src: int, dst: int, dialler_nonce: bytes, listener_nonce: bytes,
              port: int) -> bytes:
    """The key of the integrity tags on the frames ``src`` sends to ``dst`` over the link this handshake made."""
    return _auth.derive(secret, b"gradcoll-tcp-frames-v1", token, src, dst, dialler_nonce, listener_nonce, port)


def connect(store: Store, rank: int, size: int, deadline: Deadline, *, host: str = "127.0.0.1",
            sockbuf: int = SOCKBUF, key_prefix: str = "tcp", key: bytes | None = None,
            tls: TlsPair = None) -> dict[int, Linked]:
    """One connected, authenticated, ``TCP_NODELAY`` link to every other rank (peer -> ``Linked``).

    Listens on ``host`` (an ephemeral port) when this rank has higher peers
    and publishes the address under ``{key_prefix}/{rank}``; dials every lower
    rank and accepts every higher one, all before ``deadline``. ``key``: the
    group's secret, ``tls`` the (server, client) TLS contexts (see the module docstring).
    """
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} out of range for world size {size}")
    socks: dict[int, Linked] = {}
    listener = None
    acceptor = None
    try:
        if rank < size - 1:
            listener = socket.socket(_family(host), socket.SOCK_STREAM)
            _tune(listener, sockbuf)  # accepted sockets inherit the buffer sizes and the congestion control
            set_congestion(listener, congestion(host))
            listener.bind((host, 0))
            listener.listen(max(size, 128))
            token = secrets.token_bytes(16)
            port = listener.getsockname()[1]
            acceptor = _Acceptor(listener, token, port, rank, size, key, deadline, tls)  # accepts while this rank dials
            store.set(f"{key_prefix}/{rank}", f"{host} {port} {token.hex()}".encode())
        for peer in range(rank):
            socks[peer] = _dial(store, f"{key_prefix}/{peer}", rank, size, peer, deadline, sockbuf, key, tls, host)
        if acceptor is not None:
            socks.update(acceptor.result())
    except BaseException:
        for s in socks.values():
            s.sock.close()
        raise
    finally:
        if acceptor is not None:
            acceptor.stop()
        if listener is not None:
            listener.close()
    for s in socks.values():
        s.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def congestion(address: str, own: str | None = None) -> str | None:
    """The congestion control of a link to (or listening on) ``address``: ``GRADCOLL_TCP_CONGESTION`` when set,
    else ``LOCAL_CONGESTION`` when the link stays on this host (``address`` is a loopback one, or ``own``, this
    rank's), else None: the system's choice."""
    chosen = os.environ.get("GRADCOLL_TCP_CONGESTION") or None
    if chosen is not None:
        return chosen
    try:
        local = address == own or ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:  # a name, not an address
        local = address == "localhost"
    return LOCAL_CONGESTION if local else None


def set_congestion(sock: socket.socket, name: str | None) -> None:
    """Set ``name`` on ``sock`` before it connects, or on a listener before it accepts (a connection sets its
    congestion control up as it opens, and a pacing one keeps the socket paced after a later change). A name the kernel refuses (unknown,
    or not in ``net.ipv4.tcp_allowed_congestion_control``) raises a ``UsageError`` when
    ``GRADCOLL_TCP_CONGESTION`` named it, and leaves the system's choice otherwise."""
    opt = getattr(socket, "TCP_CONGESTION", None)
    if name is None or opt is None:  # (not Linux)
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, name.encode())
    except OSError as e:
        chosen = os.environ.get("GRADCOLL_TCP_CONGESTION") or None
        if chosen is not None:
            raise UsageError(f"GRADCOLL_TCP_CONGESTION={chosen!r}: the kernel refused it ({e.strerror}); the ones "
                             "a process may choose are in /proc/sys/net/ipv4/tcp_allowed_congestion_control") from None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket, sockbuf: int) -> None:
    if sockbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)


def _address(raw: bytes, key: str) -> tuple[str, int, bytes]:
    """``host port token`` as a listener published it; anything else is a ProtocolError naming the key."""
    try:
        host, port, token_hex = raw.decode("ascii").split()
        token = bytes.fromhex(token_hex)
        if not 0 < int(port) < 65536 or len(token) != 16:
            raise ValueError("port or token out of range")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"store key {key!r} holds {raw[:64]!r}, not a tcp listener's 'host port token' "
                            f"({exc})") from None
    return host, int(port), token


def _dial(store: Store, key: str, rank: int, size: int, peer: int, deadline: Deadline, sockbuf: int,
          secret: bytes | None, tls: TlsPair, own: str | None = None) -> Linked:
    """Connect to ``peer``'s listener and complete the handshake, retrying until the deadline."""
    delay: float = 0.005
    last: Exception | None = None
    while True:
        left = deadline.remaining()
        host, port, token = _address(store.get(key, left), key)
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            _tune(sock, sockbuf)
            set_congestion(sock, congestion(host, own))
            sock.settimeout(min(HANDSHAKE_TIMEOUT, left) if left is not None else HANDSHAKE_TIMEOUT)
            sock.connect((host, port))
            if tls is not None:
                sock = _wrap(tls[1], sock, host)
            if secret is None:
                sock.sendall(fr.pack_hello(fr.HELLO, rank, size, token))
            else:
                mine = _auth.nonce()
                sock.sendall(fr.pack_hello(fr.HELLO_AUTH, rank, size, token) + mine)
            ack = fr.unpack_hello(recv_exact(sock, fr.HELLO_SIZE, "handshake"))
            want = fr.ACK if secret is None else fr.ACK_AUTH
            if ack.kind != want or ack.rank != peer or ack.size != size or ack.token != token:
                raise ProtocolError(f"unexpected handshake answer {ack}")
            if secret is not None:
                got = recv_exact(sock, _auth.NONCE_SIZE + 32, "handshake proof")
                theirs, proof = got[: _auth.NONCE_SIZE], got[_auth.NONCE_SIZE :]
                if not _auth.same(proof, _auth.proof(secret, _LISTENER, token, peer, rank, mine, theirs, port)):
                    raise _Refused(f"the listener at {host}:{port} does not know the group's secret")
                sock.sendall(_auth.proof(secret, _DIALLER, token, rank, peer, theirs, mine, port))
            sock.settimeout(None)
            if secret is None:
                return Linked(sock)
            return Linked(sock, frame_key(secret, token, rank, peer, mine, theirs, port),
                          frame_key(secret, token, peer, rank, mine, theirs, port))
        except ssl.SSLError as e:
            if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):  # a listener that hung up: retry
                sock.close()
                last = e
            else:
                sock.close()
                why = (f"certificate verify failed: {e.verify_message}" if isinstance(e, ssl.SSLCertVerificationError)
                       else e.reason or str(e))
                raise ProtocolError(f"rank {rank}: refused peer {peer}: the TLS handshake with {host}:{port} failed: "
                                    f"{why} (do the ranks use certificates of the same authority?)",
                                    rank=rank, peer=peer) from None
        except UsageError:  # GRADCOLL_TCP_CONGESTION names one the kernel refuses
            sock.close()
            raise
        except _Refused as e:  # its address came from the store: a different secret, not a stale address
            sock.close()
            raise ProtocolError(f"rank {rank}: refused peer {peer}: {e} (do the ranks have different secrets?)",
                                rank=rank, peer=peer) from None
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


class _Refused(ProtocolError):
    """A peer failed the secret's proof."""


def _wrap(ctx: ssl.SSLContext, sock: socket.socket, host: str | None) -> ssl.SSLSocket:
    """``sock`` inside TLS (the handshake runs now, under the socket's timeout); a client names ``host``."""
    return ctx.wrap_socket(sock, server_side=host is None, server_hostname=host if ctx.check_hostname else None)


#: The labels of the two proofs of the authenticated handshake.
_LISTENER, _DIALLER = b"gradcoll-tcp-listener-v1", b"gradcoll-tcp-dialler-v1"


class _Acceptor:
    """The listener's side: accepts in a thread, one handshake thread per connection (see the module doc)."""

    def __init__(self, listener: socket.socket, token: bytes, port: int, rank: int, size: int, key: bytes | None,
                 deadline: Deadline, tls: TlsPair) -> None:
        self.listener, self.token, self.port, self.rank, self.size, self.key = listener, token, port, rank, size, key
        self.deadline, self.tls = deadline, tls
        self.cv = threading.Condition()
        self.socks: dict[int, tuple[Linked, object]] = {}
        self.stopped = False
        self.refused = ""  # the last connection refused, for the timeout's message
        self.thread = threading.Thread(target=self._accept, name=f"gradcoll-tcp-accept:{rank}", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.05)  # polls ``stopped``; a connection is accepted as soon as it comes
        while not self.stopped:
            try:
                conn, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn, addr), daemon=True).start()

    def _handshake(self, conn: socket.socket, addr: object) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            if self.tls is not None:
                conn = _wrap(self.tls[0], conn, None)
            hello = fr.unpack_hello(recv_exact(conn, fr.HELLO_SIZE, "handshake"))
            want = fr.HELLO if self.key is None else fr.HELLO_AUTH
            if hello.kind != want:
                raise ProtocolError("the peer has no secret but this group requires one" if self.key is not None
                                    else "the peer has a secret but this group has none")
            if hello.token != self.token or hello.size != self.size or not self.rank < hello.rank < self.size:
                raise ProtocolError(f"unexpected handshake {hello} (expecting one of ranks "
                                    f"{self.rank + 1}..{self.size - 1})")
            if self.key is None:
                conn.sendall(fr.pack_hello(fr.ACK, self.rank, self.size, self.token))
                linked = Linked(conn)
            else:
                theirs, mine = recv_exact(conn, _auth.NONCE_SIZE, "handshake nonce"), _auth.nonce()
                proof = _auth.proof(self.key, _LISTENER, self.token, self.rank, hello.rank, theirs, mine, self.port)
                conn.sendall(fr.pack_hello(fr.ACK_AUTH, self.rank, self.size, self.token) + mine + proof)
                got = recv_exact(conn, 32, "handshake proof")
                if not _auth.same(got, _auth.proof(self.key, _DIALLER, self.token, hello.rank, self.rank, mine,
                                                   theirs, self.port)):
                    raise ProtocolError(f"wrong secret: the proof of a peer claiming rank {hello.rank} does not match")
                linked = Linked(conn, frame_key(self.key, self.token, self.rank, hello.rank, theirs, mine, self.port),
                                frame_key(self.key, self.token, hello.rank, self.rank, theirs, mine, self.port))
            conn.settimeout(None)
        except (OSError, ConnectionError, ProtocolError) as e:
            log.warning("rank %d: refused a connection from %s: %s", self.rank, addr, e)
            conn.close()
            with self.cv:
                self.refused = f"{addr}: {e}"
            return
        with self.cv:
            if self.stopped or hello.rank in self.socks:
                first = self.socks.get(hello.rank)
                if first is not None:
                    log.warning("rank %d: rank %d joined twice: from %s and %s; the second is refused", self.rank,
                                hello.rank, first[1], addr)
                conn.close()
                return
            self.socks[hello.rank] = (linked, addr)
            self.cv.notify_all()

    def result(self) -> dict[int, Linked]:
        """Every higher rank's socket, once each has completed its handshake (CollectiveTimeout at the deadline)."""
        want = set(range(self.rank + 1, self.size))
        with self.cv:
            while not want <= set(self.socks):
                left = self.deadline.remaining()
                if left == 0:
                    pending = sorted(want - set(self.socks))
                    raise CollectiveTimeout(
                        f"rank {self.rank}: peers {pending} did not connect within {self.deadline.timeout}s "
                        f"(tcp transport{'; last refused: ' + self.refused if self.refused else ''})",
                        rank=self.rank, missing=pending, op="tcp accept")
                self.cv.wait(left)
            return {p: s for p, (s, _) in self.socks.items()}

    def stop(self) -> None:
        """Stop accepting; sockets not taken by ``result`` are closed."""
        with self.cv:
            self.stopped = True
            taken = set(range(self.rank + 1, self.size)) <= set(self.socks)
            leftover = [] if taken else [s for s, _ in self.socks.values()]
        self.thread.join(1.0)
        for s in leftover:
            s.sock.close()
