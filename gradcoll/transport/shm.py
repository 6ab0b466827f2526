"""Shared-memory transport: same-host ranks exchange through ring buffers.

Each pair of ranks shares one segment (``gradcoll.transport.shm_segment``:
the file, its control block, its creation, mapping and clean-up) holding two
single-producer/single-consumer rings, one per direction. This module is
the data path over them.

``head``/``tail`` count bytes ever written/consumed; the producer copies
bytes in and only then stores ``head``, the consumer copies out and then
stores ``tail``. That ordering is all the synchronisation there is, which is
correct under x86-64's total store order; ``create`` refuses other CPUs.
A message is a ``gradcoll.transport.frame`` header followed by its
payload, streamed through the ring in pieces when larger than the ring; a
header never wraps (the producer skips the ring's last bytes instead).

Waiting spins briefly, then yields, then sleeps in growing steps; every wait
is bounded by its deadline. A dead peer is noticed through the ``lockf``
lock it holds on its own byte of the segment file (released by the kernel
when the process dies, even as a zombie); an orderly close through the
state words.
"""

from __future__ import annotations

import os
import platform
import time

from .. import _auth
from .._util import Deadline
from ..errors import BackendUnavailable, ProtocolError, TransportAborted, TransportBroken, TransportClosed, UsageError
from ..store import Store
from . import frame as fr
from ._engine import FramedTransport, Link
from .base import Window
from .shm_segment import PREFIX, W_HEAD, W_STATE, W_TAIL, Segment, clean_stale_segments, connect, default_dir
from .window_shm import create as create_window

__all__ = ["ShmTransport", "create", "clean_stale_segments", "PREFIX", "RING_BYTES"]

RING_BYTES = 8 << 20
_HDR = fr.HEADER_SIZE
_OPEN, _CLOSED, _ABORTED = 0, 1, 2
_CHUNK = 256 << 10  # publish progress every 256 KiB so the consumer copies out while we copy in
_SPIN_S = 200e-6  # busy-wait this long before yielding the CPU (long enough to cover a small exchange)
_pack_header, _unpack_header = fr.HEADER.pack_into, fr.HEADER.unpack_from
_YIELD_S = 2e-3  # then yield until this long, then sleep
_PROBE_S = 0.05  # how often a waiting rank checks that its peer process is alive


class _RingLink(Link):
    """A link over the two rings of one segment."""

    def __init__(self, peer: int, seg: Segment) -> None:
        super().__init__(peer)
        me = seg.side
        self.seg, self.ctl, self.cap, self.peer_pid = seg, seg.ctl, seg.cap, seg.peer_pid
        self.out, self.inp = seg.ring(me), seg.ring(1 - me)
        self.h_out, self.t_out = W_HEAD[me], W_TAIL[me]
        self.h_in, self.t_in = W_HEAD[1 - me], W_TAIL[1 - me]
        self.my_state, self.peer_state = W_STATE[me], W_STATE[1 - me]
        self.head = self.ctl[self.h_out]  # our own counters, cached
        self.tail = self.ctl[self.t_in]
        self.same_process = self.peer_pid == os.getpid()
        self.next_probe = 0.0


class ShmTransport(FramedTransport):
    """Point-to-point transport over shared-memory rings (see the module docstring)."""

    name = "shm"
    _eager_pull = True
    shared_memory = True
    #: Where the segments live (``create``'s ``shm_dir``); the windows go there too.
    shm_dir: str | None = None
    #: The group's secret (``create``'s ``secret``), proved through every segment and window file.
    secret: bytes | None = None

    def __init__(self, rank: int, size: int, links: dict[int, _RingLink], timeout: float = 300.0,
                 crowd: int | None = None) -> None:
        super().__init__(rank, size, dict(links), timeout)
        self._rings = list(links.values())
        #: The ranks that share this machine's cores (``create``'s ``crowd``; at least this group's size).
        self.crowd = max(size, crowd or 0)
        # Ranks that are threads of this process share the GIL, and ranks that
        # outnumber the cores (every shm rank is on this host, and so may the
        # ranks of other groups: ``crowd``) share cores: either way spinning
        # would starve the peer we wait for.
        crowded = self.crowd > len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else False
        self._spin = 0.0 if crowded or all(ln.same_process for ln in self._rings) else _SPIN_S
        self._idle_since = 0.0

    # -- moving bytes ----------------------------------------------------
    def _push(self, link: _RingLink) -> bool:
        q, ctl, cap, ring = link.sendq, link.ctl, link.cap, link.out
        head, finished = link.head, False
        while q:
            op = q[0]
            free = cap - (head - ctl[link.t_out])
            if op.hdr is None:
                pad = cap - head % cap
                if pad >= _HDR:
                    pad = 0  # a header never wraps: skip the ring's last bytes instead
                if free < pad + _HDR:
                    break
                head += pad
                op.seq, link.send_seq = link.send_seq, link.send_seq + 1
                _pack_header(ring, head % cap, fr.DATA, op.tag, op.seq, op.total)
                head += _HDR
                free -= pad + _HDR
                op.hdr, op.off = True, _HDR
            n = min(free, _HDR + op.total - op.off, _CHUNK)
            if n:
                _copy_in(ring, cap, head, op.view, op.off - _HDR, n)
                head += n
                op.off += n
            if head != link.head:
                ctl[link.h_out] = link.head = head  # publish: the bytes above are in place
            elif q:
                self._probe_peer(link, reading=False)
                break
            if op.off == _HDR + op.total:
                q.popleft()
                op.done = finished = True
        return finished

    def _pull(self, link: _RingLink) -> bool:
        q, ctl, cap, ring = link.recvq, link.ctl, link.cap, link.inp
        tail, finished = link.tail, False
        head = ctl[link.h_in]
        while q:
            op = q[0]
            if op.hdr is None:
                pad = cap - tail % cap
                if pad >= _HDR:
                    pad = 0
                if head - tail < pad + _HDR:
                    break
                tail += pad
                op.seq = link.recv_seq
                kind, tag, seq, length = _unpack_header(ring, tail % cap)
                if kind != fr.DATA or tag != op.tag or seq != op.seq or length != op.total:
                    try:  # not the frame we expect: the careful path decides what it is
                        got = fr.unpack_header(ring, tail % cap)
                    except ProtocolError as e:
                        self.refuse(link, op, ProtocolError(f"rank {self.rank}: peer {link.peer} broke the protocol: "
                                                            f"{e}", rank=self.rank, peer=link.peer))
                        return True
                    tail += _HDR
                    op.hdr, op.off = True, _HDR
                    if not self._accept_header(link, op, got):
                        return True
                else:
                    tail += _HDR
                    op.hdr, op.off = True, _HDR
            n = min(head - tail, _HDR + op.total - op.off)
            if n:
                _copy_out(ring, cap, tail, op.view, op.off - _HDR, n)
                tail += n
                op.off += n
                ctl[link.t_in] = tail  # the producer may reuse that space now
            if op.off < _HDR + op.total:
                break
            q.popleft()
            self._finish_recv(link, op)
            finished = True
        if tail != link.tail:
            ctl[link.t_in] = tail
            link.tail = tail
        elif q:
            self._probe_peer(link, reading=True, seen_head=head)
        return finished

    def _probe_peer(self, link: _RingLink, reading: bool, seen_head: int = 0) -> None:
        """No progress on ``link``: fail it if the peer closed, aborted or died."""
        state = link.ctl[link.peer_state]
        if state == _OPEN:
            now = time.monotonic()
            if link.same_process or now < link.next_probe:
                return
            link.next_probe = now + _PROBE_S
            if link.seg.peer_alive():
                return
            if reading and link.ctl[link.h_in] != seen_head:
                return  # it wrote more before dying: deliver that first
            self._fail(link, TransportBroken, f"peer {link.peer} (pid {link.peer_pid}) died")
            return
        if reading and link.ctl[link.h_in] != seen_head:
            return  # data written before the close: deliver it first
        mid = reading and link.recvq[0].off > 0
        if state == _CLOSED and not mid:
            self._fail(link, TransportClosed, f"peer {link.peer} closed the link")
        elif state == _CLOSED:
            self._fail(link, TransportClosed, f"peer {link.peer} closed the link in the middle of a message")
        else:
            why = fr.abort_reason(state - _ABORTED)
            self._fail(link, TransportAborted, f"peer {link.peer} dropped the link after {why} on its side")

    def _idle(self, rounds: int, deadline: Deadline) -> None:
        now = time.monotonic()
        if rounds <= 1:
            self._idle_since = now
        idle = now - self._idle_since
        if idle < self._spin:
            return
        if idle < _YIELD_S:
            time.sleep(0)  # yields the CPU and the GIL
            return
        left = deadline.remaining()
        step = min(1e-3, idle / 20)  # sleep in steps growing with the wait, at most 1 ms
        time.sleep(step if left is None else min(step, left))

    # -- failure and close -------------------------------------------------
    def _on_fail(self, link: _RingLink, abort: int | None) -> None:
        if link.ctl[link.my_state] == _OPEN:
            link.ctl[link.my_state] = _CLOSED if abort is None else _ABORTED + abort

    def _goodbye(self, link: _RingLink) -> None:
        deadline = Deadline(1.0)  # flush what is queued, if the peer reads within a second
        while link.sendq and link.failure is None and not deadline.expired():
            if not self._push(link):
                time.sleep(0)

    def window(self, nbytes: int, timeout: float | None = None) -> Window:
        """Collective: a new window of ``nbytes`` a slot (``gradcoll.transport.window_shm``)."""
        return self._keep_window(create_window(self, nbytes, timeout, self.shm_dir, self.secret))

    def close(self) -> None:
        """Flush queued sends, mark every link closed, unmap and unlink the segments."""
        if self.closed:
            return
        self._close_windows()
        self._close_links(self._goodbye)
        for link in self._rings:
            link.out.release()
            link.inp.release()
            link.ctl.release()
            link.seg.release()


def _copy_in(ring: memoryview, cap: int, at: int, src: memoryview, start: int, n: int) -> None:
    pos = at % cap
    first = min(n, cap - pos)
    ring[pos : pos + first] = src[start : start + first]
    if first < n:
        ring[: n - first] = src[start + first : start + n]


def _copy_out(ring: memoryview, cap: int, at: int, dst: memoryview, start: int, n: int) -> None:
    pos = at % cap
    first = min(n, cap - pos)
    dst[start : start + first] = ring[pos : pos + first]
    if first < n:
        dst[start + first : start + n] = ring[: n - first]


# -- bootstrap ----------------------------------------------------------------
def create(
    store: Store,
    rank: int,
    size: int,
    *,
    timeout: float = 300.0,
    ring_bytes: int = RING_BYTES,
    shm_dir: str | None = None,
    key_prefix: str = "shm",
    secret: bytes | str | None = None,
    crowd: int | None = None,
) -> ShmTransport:
    """Connect ``rank`` to every other rank of this host through shared-memory rings.

    The lower rank of each pair creates the segment (``ring_bytes`` per
    direction, rounded up to a page) and publishes its name under
    ``{key_prefix}/{lo}-{hi}``; the higher rank maps it, unlinks the name and
    confirms (``gradcoll.transport.shm_segment``). ``shm_dir`` defaults to
    ``/dev/shm``. Use a fresh [`PrefixStore`][gradcoll.store.PrefixStore] per
    group. ``timeout`` bounds the bootstrap and becomes the transport's
    default timeout. ``secret`` (default ``$GRADCOLL_SECRET``): both sides
    of every segment, and every rank of every window, prove they know it
    (the docstrings of ``shm_segment`` and ``window_shm``). ``crowd``: how
    many ranks, of this group and others, share this machine's cores
    (default: ``size``); where they outnumber the cores, waits yield at once
    instead of spinning (a subgroup's or a two-level allreduce's links, whose
    parent group knows).
    """
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} out of range for world size {size}")
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        raise BackendUnavailable(
            f"the shm transport relies on x86 store ordering and does not run on {machine!r}; use tcp"
        )
    key = _auth.resolve(secret)
    segs = connect(store, rank, size, Deadline(timeout), ring_bytes=ring_bytes, directory=shm_dir or default_dir(),
                   key_prefix=key_prefix, key=key)
    transport = ShmTransport(rank, size, {peer: _RingLink(peer, seg) for peer, seg in segs.items()}, timeout, crowd)
    transport.shm_dir, transport.secret = shm_dir, key
    return transport
