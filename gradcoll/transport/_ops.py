"""The queue engine's operations and per-peer links (``gradcoll.transport._engine``); private.

An ``Op`` is one queued send or receive; a ``Link`` holds a peer's two
queues, its sequence numbers and its sticky failure. ``withdraw`` and
``detach`` are what a failed call does to an op it leaves behind: take it
off its queue when no byte of it has moved, or let a send go on from a copy
of the caller's buffer when some have.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .base import QueuedRequest, _Queues

__all__ = ["Op", "Link", "all_done", "withdraw", "detach"]


class Op(QueuedRequest):
    """One queued send or receive; ``off`` counts bytes moved, header included."""

    __slots__ = ("_t", "link", "is_send", "view", "tag", "total", "off", "hdr", "seq", "done", "error", "stray",
                 "ext")

    def __init__(self, t: _Queues, link: "Link", is_send: bool, view: memoryview, tag: int) -> None:
        self._t, self.link, self.is_send, self.view, self.tag = t, link, is_send, view, tag
        self.total = len(view)
        self.off = 0
        self.hdr: Any = None
        self.seq = -1
        self.done = False
        self.error: BaseException | None = None
        self.stray: Any = None  # (tag, expected length) once a lenient receive is redirected to a stray frame
        self.ext: Any = None  # a secure tcp link's frame state (gradcoll.transport.tcp_secure)

    def describe(self, with_peer: bool = True) -> str:
        """E.g. ``recv from peer 2 (seq 7, tag 0, 4096 bytes)``."""
        where = ("send", "to") if self.is_send else ("recv", "from")
        seq = f"seq {self.seq}, " if self.seq >= 0 else ""
        peer = f" {where[1]} peer {self.link.peer}" if with_peer else ""
        return f"{where[0]}{peer} ({seq}tag {self.tag}, {self.total} bytes)"


def all_done(ops: tuple[Op, ...]) -> bool:
    """True when every op is done, or one of them failed (a sendrecv whose receive failed ends; its send goes
    on in the background, like any op left behind by a failed collective)."""
    done = True
    for op in ops:
        if not op.done:
            done = False
        elif op.error is not None:
            return True
    return done


class Link:
    """Per-peer queues and sequence numbers; subclasses add the medium (socket, ring)."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.sendq: deque[Op] = deque()
        self.recvq: deque[Op] = deque()
        self.send_seq = self.recv_seq = 0
        self.failure: tuple[type, str] | None = None  # sticky (exception class, reason)


def withdraw(op: Op) -> None:
    """Take ``op``, no byte of which has moved, off its queue (lock held); the link stays in step."""
    link = op.link
    if op.is_send:
        link.sendq.remove(op)
        if op.seq >= 0:  # numbered at the head of the queue but never sent: the next send reuses it
            link.send_seq = op.seq
    else:
        link.recvq.remove(op)


def detach(op: Op) -> None:
    """Let the send ``op``, half way through its frame, go on in the background from a copy of its buffer (lock
    held): its caller has the buffer back once the call failed, and what it writes there must not reach a peer
    as the rest of the frame."""
    old, op.view = op.view, memoryview(bytearray(op.view))
    if isinstance(op.hdr, list):  # a secure link's frame pieces hold the payload's view too
        op.hdr = [op.view if piece is old else piece for piece in op.hdr]
