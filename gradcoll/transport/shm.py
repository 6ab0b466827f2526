"""Shared-memory transport: same-host ranks exchange through ring buffers.

Each pair of ranks shares one segment, a file in ``/dev/shm`` that both map
(``mmap`` directly, so Python's ``resource_tracker`` never sees it). It holds
a 4 KiB control block and two single-producer/single-consumer rings, one
per direction. Control block, in u64 words, counters on their own cache
lines:

    0 magic | 1 ring capacity | 2 creator pid | 3 attacher pid
    16 head of ring 0 (low -> high rank)  | 24 tail of ring 0
    48 head of ring 1 (high -> low rank)  | 56 tail of ring 1
    80 state of the low rank | 88 state of the high rank   (0 open, 1 closed, 2+code aborted)

``head``/``tail`` count bytes ever written/consumed; the producer copies
bytes in and only then stores ``head``, the consumer copies out and then
stores ``tail``. That ordering is all the synchronisation there is, which is
correct under x86-64's total store order; ``create`` refuses other CPUs.
A message is a ``gradcoll.transport._frame`` header followed by its
payload, streamed through the ring in pieces when larger than the ring; a
header never wraps (the producer skips the ring's last bytes instead).

The whole segment is allocated when it is created (``posix_fallocate``) and
mapped with ``MAP_POPULATE`` on both sides, so no byte that travels later
takes a page fault. Mapped lazily, the first pass of the traffic through
each ring (8 MiB per direction) faulted one page in per 4 KiB on each side:
about 35 faults in each rank per 128 KiB allreduce on 2 ranks, 40% of its
time. Where ``/dev/shm`` has no room for the whole segment, a warning says
so and the pages come on first touch, as before (a write past the room
fails with SIGBUS, as it always did).

Waiting spins briefly, then yields, then sleeps in growing steps; every wait
is bounded by its deadline. A dead peer is noticed through a ``lockf`` lock
each side holds on its own byte of the segment file (released by the kernel
when the process dies, even as a zombie); an orderly close through the
state words. Segments are named ``gcshm-<creator pid>-<token>-<lo>-<hi>``,
unlinked as soon as the peer has mapped them, and ``create`` removes
stale ones whose creator is dead.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import platform
import secrets
import socket
import tempfile
import time

from ..errors import BackendUnavailable, ProtocolError, TransportBroken, TransportClosed, UsageError
from ..store import Store
from . import frame as fr
from .base import Deadline

__all__ = ["ShmTransport", "create"]

log = logging.getLogger(__name__)

RING_BYTES = 8 << 20
PREFIX = "gcshm-"
_MAGIC = 0x4743_5348_4D00_0001  # "GCSHM", layout version 1
_CTRL = 4096
_HDR = fr.HEADER_SIZE
_W_MAGIC, _W_CAP, _W_PID = 0, 1, (2, 3)
_W_HEAD, _W_TAIL, _W_STATE = (16, 48), (24, 56), (80, 88)
_OPEN, _CLOSED, _ABORTED = 0, 1, 2
_CHUNK = 256 << 10  # publish progress every 256 KiB so the consumer copies out while we copy in
_SPIN_S = 200e-6  # busy-wait this long before yielding the CPU (a small exchange takes ~20 us)
_pack_header, _unpack_header = fr.HEADER.pack_into, fr.HEADER.unpack_from
_YIELD_S = 2e-3  # then yield until this long, then sleep
_PROBE_S = 0.05  # how often a waiting rank checks that its peer process is alive
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page now, not on its first touch


class _Segment:
    """One mapped pair segment; ``side`` is 0 for the lower rank (its creator), 1 for the higher."""

    def __init__(self, path: str, fd: int, side: int, created: bool) -> None:
        self.path, self.fd, self.side, self.created = path, fd, side, created
        self.unlinked = False
        # The lock on our own byte tells the peer "alive" until this process exits.
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, side)
        self.mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | _POPULATE)
        self.view = memoryview(self.mm)
        self.ctl = self.view[:_CTRL].cast("Q")

    def unlink(self) -> None:
        """Remove the name; the mappings stay valid."""
        if not self.unlinked:
            self.unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        """Unmap and close (after the transport is done with every view)."""
        if self.created:
            self.unlink()
        try:
            self.ctl.release()
            self.view.release()
            self.mm.close()
        except BufferError:  # a stray view (e.g. held by a traceback): let GC unmap it
            pass
        os.close(self.fd)


class _RingLink(fr.Link):
    """A link over the two rings of one segment."""

    def __init__(self, peer: int, seg: _Segment, cap: int, peer_pid: int) -> None:
        super().__init__(peer)
        me = seg.side
        self.seg, self.ctl, self.cap, self.peer_pid = seg, seg.ctl, cap, peer_pid
        self.out = seg.view[_CTRL + me * cap : _CTRL + (me + 1) * cap]
        self.inp = seg.view[_CTRL + (1 - me) * cap : _CTRL + (2 - me) * cap]
        self.h_out, self.t_out = _W_HEAD[me], _W_TAIL[me]
        self.h_in, self.t_in = _W_HEAD[1 - me], _W_TAIL[1 - me]
        self.my_state, self.peer_state = _W_STATE[me], _W_STATE[1 - me]
        self.head = self.ctl[self.h_out]  # our own counters, cached
        self.tail = self.ctl[self.t_in]
        self.peer_byte = 1 - me
        self.same_process = peer_pid == os.getpid()
        self.next_probe = 0.0


def _pad(count: int, cap: int) -> int:
    """Bytes to skip so that a header starting at ``count`` does not wrap."""
    room = cap - count % cap
    return room if room < _HDR else 0


class ShmTransport(fr.FramedTransport):
    """Point-to-point transport over shared-memory rings (see the module docstring)."""

    name = "shm"
    _eager_pull = True

    def __init__(self, rank: int, size: int, links: dict[int, _RingLink], timeout: float = 300.0) -> None:
        super().__init__(rank, size, dict(links), timeout)
        self._rings = list(links.values())
        # Ranks that are threads of this process share the GIL, and ranks that
        # outnumber the cores (every shm rank is on this host) share cores:
        # either way spinning would starve the peer we wait for.
        crowded = size > len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else False
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
                        self._fail(link, TransportBroken, f"peer {link.peer} broke the protocol: {e}", e,
                                   fr.ABORT_PROTOCOL)
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
            try:  # the peer holds this lock for as long as it lives
                fcntl.lockf(link.seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, link.peer_byte)
            except OSError:
                return
            fcntl.lockf(link.seg.fd, fcntl.LOCK_UN, 1, link.peer_byte)
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
            self._fail(link, TransportBroken, f"peer {link.peer} closed the link in the middle of a message")
        else:
            why = fr.ABORT_REASONS.get(state - _ABORTED, fr.ABORT_REASONS[fr.ABORT_ERROR])
            self._fail(link, TransportBroken, f"peer {link.peer} dropped the link after {why} on its side")

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

    def close(self) -> None:
        """Flush queued sends, mark every link closed, unmap and unlink the segments."""
        if self.closed:
            return
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
) -> ShmTransport:
    """Connect ``rank`` to every other rank of this host through shared-memory rings.

    The lower rank of each pair creates the segment (``ring_bytes`` per
    direction, rounded up to a page) and publishes its name under
    ``{key_prefix}/{lo}-{hi}``; the higher rank maps it, unlinks the name and
    confirms. ``shm_dir`` defaults to ``/dev/shm``. Use a fresh
    [`PrefixStore`][gradcoll.store.PrefixStore] per group. ``timeout`` bounds the
    bootstrap and becomes the transport's default timeout.
    """
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} out of range for world size {size}")
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        raise BackendUnavailable(
            f"the shm transport relies on x86 store ordering and does not run on {machine!r}; use tcp"
        )
    directory = shm_dir or _default_dir()
    cap = max(4096, -(-int(ring_bytes) // 4096) * 4096)
    deadline = Deadline(timeout)
    clean_stale_segments(directory)
    host, token = socket.gethostname(), secrets.token_hex(6)
    created: dict[int, _Segment] = {}
    links: dict[int, _RingLink] = {}
    try:
        for peer in range(rank + 1, size):
            created[peer] = seg = _create_segment(directory, f"{PREFIX}{os.getpid()}-{token}-{rank}-{peer}", cap)
            store.set(f"{key_prefix}/{rank}-{peer}", f"{host} {os.path.basename(seg.path)}".encode())
        for peer in range(rank):
            seg = _attach(store, f"{key_prefix}/{peer}-{rank}", directory, host, rank, peer, deadline)
            links[peer] = _RingLink(peer, seg, seg.ctl[_W_CAP], seg.ctl[_W_PID[0]])
            store.set(f"{key_prefix}/{peer}-{rank}/attached", b"1")
        for peer, seg in created.items():
            store.get(f"{key_prefix}/{rank}-{peer}/attached", deadline.remaining())
            seg.unlink()
            links[peer] = _RingLink(peer, seg, cap, seg.ctl[_W_PID[1]])
    except BaseException:
        for link in links.values():
            link.out.release()
            link.inp.release()
        _release_all([ln.seg for ln in links.values()] + [s for p, s in created.items() if p not in links])
        raise
    return ShmTransport(rank, size, links, timeout)


def _release_all(segs: list[_Segment]) -> None:
    for seg in segs:
        seg.unlink()
        seg.release()


def _default_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _create_segment(directory: str, name: str, cap: int) -> _Segment:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, _CTRL + 2 * cap)
        _allocate(fd, _CTRL + 2 * cap, directory)
        seg = _Segment(path, fd, side=0, created=True)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    seg.ctl[_W_CAP] = cap
    seg.ctl[_W_PID[0]] = os.getpid()
    seg.ctl[_W_MAGIC] = _MAGIC
    return seg


def _allocate(fd: int, nbytes: int, directory: str) -> None:
    """Give the segment file all its pages now (where the file system can; else they come on first touch)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            log.warning("no room to allocate a %d-byte shm segment in %s up front (%s): its pages come on first "
                        "touch, and a write past the room fails with SIGBUS; make %s larger or pass a smaller "
                        "ring_bytes", nbytes, directory, exc.strerror, directory)
        elif exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    except AttributeError:  # no posix_fallocate on this platform
        pass


def _attach(store: Store, key: str, directory: str, host: str, rank: int, peer: int, deadline: Deadline) -> _Segment:
    """Map the segment ``peer`` published under ``key``; retry a stale name until the deadline."""
    delay = 0.005
    while True:
        their_host, name = store.get(key, deadline.remaining()).decode().split()
        if their_host != host:
            raise UsageError(
                f"rank {rank}: the shm transport needs every rank on one host; "
                f"peer {peer} is on {their_host}, this rank on {host}"
            )
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDWR)
            break
        except FileNotFoundError:
            if deadline.expired():
                raise TransportBroken(f"rank {rank}: segment {name} of peer {peer} vanished", rank=rank, peer=peer) from None
        time.sleep(delay)  # a stale name from an earlier group: wait for the new one
        delay = min(2 * delay, 0.1)
    try:
        seg = _Segment(os.path.join(directory, name), fd, side=1, created=False)
    except BaseException:
        os.close(fd)
        raise
    if seg.ctl[_W_MAGIC] != _MAGIC:
        seg.release()
        raise ProtocolError(f"rank {rank}: {name} is not a gradcoll shm segment (or another layout version)")
    seg.ctl[_W_PID[1]] = os.getpid()
    seg.unlink()  # both sides have it mapped: nothing can leak from here on
    return seg


def clean_stale_segments(directory: str | None = None) -> int:
    """Unlink segments whose creator process no longer exists; return how many."""
    directory = directory or _default_dir()
    removed = 0
    for name in os.listdir(directory):
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-", 1)[0])
            os.kill(pid, 0)  # a probe only; never opens a live segment (that could drop its locks)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:
                pass
        except (ValueError, PermissionError):
            pass
    return removed
