"""Opening a group's control channel (``gradcoll.observe.diagnosis.ControlChannel``) through the bootstrap store."""

from __future__ import annotations

import secrets
import socket
from typing import Any

from .. import _auth
from ..errors import ProtocolError
from ..store import Store
from .diagnosis import ControlChannel

__all__ = ["open_control"]


def open_control(store: Store, rank: int, size: int, *, timeout: float, host: str = "127.0.0.1",
                 backend: str = "", options: dict[str, Any] | None = None, generation: int = 0) -> ControlChannel:
    """Bind this rank's control socket on ``host`` and learn every peer's address through ``store``.

    The group's secret, if any, is the ``secret`` transport option (``init_process_group(secret=...)``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind((host, 0))
        k = store.add(f"control/calls/{rank}", 1)  # the k-th group on a rank meets the k-th on the others
        if rank == 0:
            store.set(f"control/{k}/token", secrets.token_bytes(8))
        store.set(f"control/{k}/{rank}", f"{host} {sock.getsockname()[1]}".encode())
        token = store.get(f"control/{k}/token", timeout)
        addrs = [_address(store.get(f"control/{k}/{r}", timeout), r) for r in range(size)]
    except BaseException:
        sock.close()
        raise
    opts = options or {}
    return ControlChannel(sock, rank, size, addrs, token, host=host, backend=backend, options=opts,
                          generation=generation, key=_auth.resolve(opts.get("secret")))


def _address(raw: bytes, r: int) -> tuple[str, int]:
    """Rank ``r``'s ``host port`` from the store; anything else is a ProtocolError naming it."""
    try:
        h, p = raw.decode("ascii").split(" ")
        if not 0 < int(p) < 65536:
            raise ValueError(f"port {p} out of range")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"the store's control address of rank {r} is {raw[:64]!r}, not 'host port' ({exc})") \
            from None
    return h, int(p)
