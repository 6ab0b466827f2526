"""Shared-memory segments of the shm transport: create, attach, populate, clean up.

Each pair of ranks shares one segment, a file in ``/dev/shm`` that both map
(``mmap`` directly, so Python's ``resource_tracker`` never sees it): a 4 KiB
control block, then ring 0 (low -> high rank) and ring 1 (high -> low rank)
of ``cap`` bytes each. Control block, in u64 words, counters on their own
cache lines:

    0 magic | 1 ring capacity | 2 creator pid | 3 attacher pid
    16 head of ring 0 (low -> high rank)  | 24 tail of ring 0
    48 head of ring 1 (high -> low rank)  | 56 tail of ring 1
    80 state of the low rank | 88 state of the high rank   (0 open, 1 closed, 2+code aborted)

The rings themselves (``head``/``tail``, the state words) are the data
path's business, ``gradcoll.transport.shm``; this module owns the file.

The whole segment is allocated when it is created (``posix_fallocate``) and
mapped with ``MAP_POPULATE`` on both sides, so no byte that travels later
takes a page fault. Mapped lazily, the first pass of the traffic through
each ring (8 MiB per direction) faulted one page in per 4 KiB on each side,
a large share of a mid-sized allreduce's time. Where ``/dev/shm`` has no
room for the whole segment, a warning says so and the pages come on first
touch (a write past the room fails with SIGBUS).

Each side holds a ``lockf`` lock on its own byte of the file for as long as
it lives (the kernel releases it when the process dies, even as a zombie),
which is how a waiting peer notices a dead one. Segments are named
``gcshm-<creator pid>-<token>-<lo>-<hi>``, unlinked as soon as the peer has
mapped them, and ``connect`` removes stale ones whose creator is dead.

The name a peer publishes is trusted no further than it can be checked:
the attaching rank accepts only that exact pattern (no path separators,
its own pair of ranks), opens it with ``O_NOFOLLOW`` and maps it only if it
is a regular file owned by this user with mode 0600 and big enough for its
own layout. With the group's secret the creator writes an HMAC proof bound
to the segment's name and both ranks into the control block before
publishing it, and the attacher writes its own proof back, which the
creator checks before it uses the segment: a segment planted by a stranger
(or a peer without the secret) is refused with a ProtocolError
(``gradcoll.transport._shm_proof``, shared with the windows).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import tempfile
import time

from .._util import Deadline
from ..errors import ProtocolError, TransportBroken, UsageError
from ..store import Store
from . import _shm_proof

__all__ = ["Segment", "connect", "clean_stale_segments", "default_dir", "PREFIX", "CTRL", "W_HEAD", "W_TAIL",
           "W_STATE"]

log = logging.getLogger("gradcoll.transport.shm")  # the transport's logger, as before the split

PREFIX = "gcshm-"
MAGIC = 0x4743_5348_4D00_0001  # "GCSHM", layout version 1
#: Bytes of the control block before the rings.
CTRL = 4096
W_MAGIC, W_CAP, W_PID = 0, 1, (2, 3)
#: Control words per ring (index 0: low -> high rank, 1: high -> low) and per side.
W_HEAD, W_TAIL, W_STATE = (16, 48), (24, 56), (80, 88)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page now, not on its first touch
#: Bytes of the control block holding the creator's and the attacher's proofs of the secret.
PROOFS = (2048, 2080)
_NAME = re.compile(r"gcshm-(\d+)-[0-9a-f]{12}-(\d+)-(\d+)")
_CREATOR, _ATTACHER = b"gradcoll-shm-creator-v1", b"gradcoll-shm-attacher-v1"


class Segment:
    """One mapped pair segment; ``side`` is 0 for the lower rank (its creator), 1 for the higher."""

    def __init__(self, path: str, fd: int, side: int, created: bool) -> None:
        self.path, self.fd, self.side, self.created = path, fd, side, created
        self.unlinked = False
        # The lock on our own byte tells the peer "alive" until this process exits.
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, side)
        self.mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | _POPULATE)
        self.view = memoryview(self.mm)
        self.ctl = self.view[:CTRL].cast("Q")

    @property
    def cap(self) -> int:
        """Bytes per ring."""
        return int(self.ctl[W_CAP])

    @property
    def peer_pid(self) -> int:
        """The pid of the process on the other side (0 until it has attached)."""
        return int(self.ctl[W_PID[1 - self.side]])

    def ring(self, index: int) -> memoryview:
        """Ring 0 (low -> high rank) or ring 1 (high -> low rank)."""
        cap = self.cap
        return self.view[CTRL + index * cap : CTRL + (index + 1) * cap]

    def peer_alive(self) -> bool:
        """True while the peer process holds the lock on its byte (it is alive)."""
        peer_byte = 1 - self.side
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, peer_byte)
        except OSError:
            return True
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, peer_byte)
        return False

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


def connect(store: Store, rank: int, size: int, deadline: Deadline, *, ring_bytes: int, directory: str,
            key_prefix: str = "shm", key: bytes | None = None) -> dict[int, Segment]:
    """One mapped segment shared with every other rank of this host (peer -> segment).

    The lower rank of each pair creates the segment (``ring_bytes`` per
    direction, rounded up to a page) and publishes its name under
    ``{key_prefix}/{lo}-{hi}``; the higher rank maps it, unlinks the name and
    confirms. On failure every segment made so far is unlinked and unmapped.
    """
    cap = max(4096, -(-int(ring_bytes) // 4096) * 4096)
    clean_stale_segments(directory)
    host, token = socket.gethostname(), secrets.token_hex(6)
    created: dict[int, Segment] = {}
    segs: dict[int, Segment] = {}
    try:
        for peer in range(rank + 1, size):
            created[peer] = seg = _create(directory, f"{PREFIX}{os.getpid()}-{token}-{rank}-{peer}", cap)
            if key is not None:
                _write_proof(seg, key, _CREATOR, rank, peer, 0)
            store.set(f"{key_prefix}/{rank}-{peer}", f"{host} {os.path.basename(seg.path)}".encode())
        for peer in range(rank):
            segs[peer] = _attach(store, f"{key_prefix}/{peer}-{rank}", directory, host, rank, peer, deadline, key)
            store.set(f"{key_prefix}/{peer}-{rank}/attached", b"1")
        for peer, seg in created.items():
            store.get(f"{key_prefix}/{rank}-{peer}/attached", deadline.remaining())
            seg.unlink()
            if key is not None and not _check_proof(seg, key, _ATTACHER, rank, peer, 1):
                raise ProtocolError(f"rank {rank}: the process that attached to the segment shared with peer {peer} "
                                    f"did not prove the group's secret", rank=rank, peer=peer)
            segs[peer] = seg
    except BaseException:
        for seg in [*segs.values(), *(s for p, s in created.items() if p not in segs)]:
            seg.unlink()
            seg.release()
        clean_stale_segments(directory)  # a peer killed during startup leaves its segments: the survivor removes them
        raise
    return segs


def default_dir() -> str:
    """``/dev/shm`` where there is one, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _create(directory: str, name: str, cap: int) -> Segment:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, CTRL + 2 * cap)
        _allocate(fd, CTRL + 2 * cap, directory)
        seg = Segment(path, fd, side=0, created=True)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    seg.ctl[W_CAP] = cap
    seg.ctl[W_PID[0]] = os.getpid()
    seg.ctl[W_MAGIC] = MAGIC
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


def _write_proof(seg: Segment, key: bytes, role: bytes, lo: int, hi: int, which: int) -> None:
    _shm_proof.write(seg.view, PROOFS[which], key, role, os.path.basename(seg.path), lo, hi)


def _check_proof(seg: Segment, key: bytes, role: bytes, lo: int, hi: int, which: int) -> bool:
    return _shm_proof.check(seg.view, PROOFS[which], key, role, os.path.basename(seg.path), lo, hi)


def _name(raw: bytes, key: str, rank: int, peer: int) -> tuple[str, str]:
    """(host, segment name) as ``peer`` published them; a name of any other shape is a ProtocolError."""
    try:
        their_host, name = raw.decode("ascii").split()
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"rank {rank}: store key {key!r} holds {raw[:64]!r}, not 'host segment-name'",
                            rank=rank, peer=peer) from None
    m = _NAME.fullmatch(name)
    if m is None or (int(m[2]), int(m[3])) != (peer, rank):
        raise ProtocolError(f"rank {rank}: peer {peer} published the shm segment name {name[:80]!r}, which is not "
                            f"{PREFIX}<pid>-<token>-{peer}-{rank}: refused", rank=rank, peer=peer)
    return their_host, name


def _open_checked(path: str, rank: int, peer: int) -> int:
    """Open a segment file only if it is a regular file of this user with mode 0600 (no symbolic link)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
           f"owned by uid {st.st_uid}, not {os.getuid()}" if st.st_uid != os.getuid() else
           f"mode {stat.S_IMODE(st.st_mode):o}, not 600" if stat.S_IMODE(st.st_mode) != 0o600 else
           f"{st.st_size} bytes, too small" if st.st_size < CTRL + 2 * 4096 else "")
    if why:
        os.close(fd)
        raise ProtocolError(f"rank {rank}: refused peer {peer}'s shm segment {path}: {why}", rank=rank, peer=peer)
    return fd


def _attach(store: Store, key: str, directory: str, host: str, rank: int, peer: int, deadline: Deadline,
            secret: bytes | None = None) -> Segment:
    """Map the segment ``peer`` published under ``key``; retry a stale name until the deadline."""
    delay = 0.005
    while True:
        their_host, name = _name(store.get(key, deadline.remaining()), key, rank, peer)
        if their_host != host:
            raise UsageError(
                f"rank {rank}: the shm transport needs every rank on one host; "
                f"peer {peer} is on {their_host}, this rank on {host}"
            )
        try:
            fd = _open_checked(os.path.join(directory, name), rank, peer)
            break
        except FileNotFoundError:
            if deadline.expired():
                raise TransportBroken(f"rank {rank}: segment {name} of peer {peer} vanished", rank=rank, peer=peer) from None
        except OSError as exc:  # O_NOFOLLOW met a symbolic link (ELOOP), or no permission
            raise ProtocolError(f"rank {rank}: refused peer {peer}'s shm segment {name}: {exc.strerror}",
                                rank=rank, peer=peer) from None
        time.sleep(delay)  # a stale name from an earlier group: wait for the new one
        delay = min(2 * delay, 0.1)
    try:
        seg = Segment(os.path.join(directory, name), fd, side=1, created=False)
    except BaseException:
        os.close(fd)
        raise
    if seg.ctl[W_MAGIC] != MAGIC or CTRL + 2 * seg.cap > len(seg.view):
        seg.release()
        raise ProtocolError(f"rank {rank}: {name} is not a gradcoll shm segment (or another layout version)")
    if secret is not None and not _check_proof(seg, secret, _CREATOR, peer, rank, 0):
        seg.release()
        raise ProtocolError(f"rank {rank}: the shm segment {name} published as peer {peer}'s does not prove the "
                            f"group's secret: refused", rank=rank, peer=peer)
    if secret is not None:
        _write_proof(seg, secret, _ATTACHER, peer, rank, 1)
    seg.ctl[W_PID[1]] = os.getpid()
    seg.unlink()  # both sides have it mapped: nothing can leak from here on
    return seg


def clean_stale_segments(directory: str | None = None) -> int:
    """Unlink segments whose creator process no longer exists; return how many."""
    directory = directory or default_dir()
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
