"""The shm transport's windows: one segment file per window, made over the transport's own links.

``create`` is collective. Rank 0 creates ``gcshm-<pid>-<token>-w`` in
``/dev/shm`` (mode 0600, allocated in full and mapped with ``MAP_POPULATE``,
as the pair segments of ``shm_segment`` are), writes the window's global
header and sends every peer the name (tag ``WINDOW_TAG``). Each peer opens
and maps it, takes a ``lockf`` lock on its own byte ``rank`` of the file,
writes its pid into its header and answers. Once every peer has answered,
rank 0 unlinks the name, so nothing can be left behind from then on, even if
a rank is killed, and tells every peer to go. A rank killed before that
leaves a name whose creator pid is dead, which the next group's start-up
removes (``shm_segment.clean_stale_segments``).

With the group's secret, rank 0 writes a proof bound to the window's name
and the world size into the first page (``PROOF_AT``) before it sends the
name, and each peer checks it right after mapping the file, before it
writes anything into it (its pid, then any data): a file that a stranger
running as this user put under that name is refused with a ProtocolError
naming the rank that refused it, on that rank and on rank 0. Each peer then
writes its own proof at ``PROOF_AT + 32 * rank``, which rank 0 checks before
it says go (``gradcoll.transport._shm_proof``, shared with the pair
segments).

The locks are how a waiting rank notices a dead peer: the kernel releases a
process's ``lockf`` locks when it dies (even as a zombie), and ``F_GETLK``
on the peer's byte then finds the byte free.

The mapping is made with the C library's ``mmap``, not Python's: Python's
keeps a duplicate of the file descriptor until it is closed, and it cannot be
closed while an array still views it (an array from ``ProcessGroup.alloc``
may outlive the group). Here ``close`` closes the one descriptor (the
process's lock goes with it) and the pages are unmapped when the last array
viewing them is gone.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import weakref
from typing import Any

from .._util import Deadline
from ..errors import CollectiveTimeout, GradcollError, ProtocolError, UsageError
from . import _shm_proof
from .base import Transport
from .shm_segment import PREFIX, _allocate, default_dir
from .window import LAYOUT, WINDOW_TAG, MappedWindow, init_header, plan

__all__ = ["create"]

_MSG = 256
_WINDOW_NAME = re.compile(re.escape(PREFIX) + r"\d+-[0-9a-f]{12}-w")
#: Seconds an attaching rank waits for rank 0's verdict past the set-up's deadline (see ``_attach``).
GO_GRACE_S = 0.5
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: Where the proofs of the secret live in the window's first page (after the global header, before the
#: ranks' headers): rank 0's at ``PROOF_AT``, rank r's at ``PROOF_AT + 32 * r`` (64 ranks fill the page).
PROOF_AT = 2048
_CREATOR, _ATTACHER = b"gradcoll-window-creator-v1", b"gradcoll-window-attacher-v1"


def _message(kind: str, text: str) -> bytes:
    return f"{kind} {text}".encode()[:_MSG].ljust(_MSG, b"\0")


def _parse(buf: bytes | bytearray) -> tuple[str, str]:
    kind, _, text = bytes(buf).rstrip(b"\0").decode(errors="replace").partition(" ")
    return kind, text


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, total: int) -> Any:
    """``total`` bytes of ``fd`` mapped shared, as a ctypes array; unmapped when the last view of it is gone."""
    addr = _libc.mmap(None, total, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _POPULATE, fd, 0)
    if addr is None or addr == _FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a {total}-byte window failed: {os.strerror(err)}")
    buf = (ctypes.c_char * total).from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, total)
    return buf


def _set_pid(mm: Any, rank: int, size: int, slot_bytes: int) -> None:
    _, headers, _, _ = plan(size, slot_bytes)
    struct.pack_into("<Q", mm, headers + rank * 1024 + LAYOUT["pid"], os.getpid())


def _window(mm: Any, fd: int, rank: int, size: int, crowd: int | None = None) -> MappedWindow:
    return MappedWindow(mm, rank, size, probe=1, fd=fd, release=lambda: os.close(fd), crowd=crowd)


def create(t: Transport, nbytes: int, timeout: float | None, directory: str | None = None,
           key: bytes | None = None) -> MappedWindow:
    """Map a new window with ``nbytes`` per slot for every rank of ``t`` (collective; see the module docstring).

    ``key``: the group's secret (the transport's), proved by every rank through the window file itself.
    """
    if nbytes < 0:
        raise UsageError(f"rank {t.rank}: a window slot cannot have {nbytes} bytes")
    deadline = Deadline(t.timeout if timeout is None else timeout)
    total = plan(t.size, nbytes)[0]
    directory = directory or default_dir()
    if t.rank == 0:
        return _create(t, nbytes, total, directory, deadline, key)
    return _attach(t, nbytes, total, directory, deadline, key)


def _create(t: Transport, nbytes: int, total: int, directory: str, deadline: Deadline,
            key: bytes | None) -> MappedWindow:
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}-w"
    path = os.path.join(directory, name)
    peers = range(1, t.size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    mm: Any = None
    try:
        try:
            os.ftruncate(fd, total)
            _allocate(fd, total, directory)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            mm = _map(fd, total)
            init_header(mm, t.size, nbytes)
            if key is not None:
                _shm_proof.write(mm, PROOF_AT, key, _CREATOR, name, 0, t.size)
            _set_pid(mm, 0, t.size, nbytes)
            note = _message("OK", f"{socket.gethostname()} {name} {total}")
        except OSError as exc:
            note = _message("ER", f"rank 0 could not create a {total}-byte window in {directory}: {exc}")
        for p in peers:
            t.send(p, note, WINDOW_TAG, deadline.remaining())
        if _parse(note)[0] != "OK":
            raise GradcollError(f"rank 0: {_parse(note)[1]}")
        answers: dict[int, tuple[str, str]] = {}
        missing = []
        for p in peers:
            try:
                answers[p] = _parse(_recv(t, p, deadline))
            except CollectiveTimeout:
                missing.append(p)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    os.unlink(path)  # every rank has it mapped (or gave up): nothing can leak from here on
    assert mm is not None
    for p, (kind, _) in answers.items():
        if kind == "OK" and key is not None and not _shm_proof.check(mm, PROOF_AT + 32 * p, key, _ATTACHER, name,
                                                                     p, t.size):
            answers[p] = ("PR", f"rank {p}: the process that attached to window {name} as rank {p} did not prove "
                                "the group's secret: refused")
    failed = [text if text.startswith(f"rank {p}:") else f"rank {p}: {text}" for p, (kind, text) in answers.items()
              if kind != "OK"]
    refused = [p for p, (kind, _) in answers.items() if kind == "PR"]
    go = (_message("TO", ",".join(map(str, missing))) if missing else
          _message("PR" if refused else "ER", "; ".join(failed)) if failed else _message("GO", ""))
    for p in answers:
        t.send(p, go, WINDOW_TAG, deadline.remaining())
    if missing or failed:
        os.close(fd)
        _raise(0, *_parse(go), peer=refused[0] if refused else None)
    return _window(mm, fd, 0, t.size, getattr(t, "crowd", None))


def _raise(rank: int, kind: str, text: str, peer: int | None = None) -> None:
    """The error of a set-up that failed: TO lists the ranks that did not answer in time; PR is a refused proof."""
    if kind == "TO":
        who = [int(r) for r in text.split(",")]
        raise CollectiveTimeout(f"rank {rank}: window set-up: rank(s) {text} did not arrive", rank=rank, missing=who)
    if kind == "PR":
        raise ProtocolError(f"rank {rank}: the window could not be set up: {text}", rank=rank, peer=peer)
    raise GradcollError(f"rank {rank}: the window could not be set up: {text}")


def _recv(t: Transport, peer: int, deadline: Deadline) -> bytearray:
    buf = bytearray(_MSG)
    t.recv(peer, buf, WINDOW_TAG, deadline.remaining())
    return buf


def _attach(t: Transport, nbytes: int, total: int, directory: str, deadline: Deadline,
            key: bytes | None) -> MappedWindow:
    me = t.rank
    kind, text = _parse(_recv(t, 0, deadline))
    if kind != "OK":
        raise GradcollError(f"rank {me}: {text}")
    fd = -1
    mm: Any = None
    refused: ProtocolError | None = None
    try:
        parts = text.split()
        if len(parts) != 3 or not parts[2].isdigit():
            raise ProtocolError(f"rank {me}: rank 0 announced the window as {text[:80]!r}, not 'host name bytes'",
                                rank=me, peer=0)
        host, name, size = parts
        if host != socket.gethostname() or int(size) != total:
            raise UsageError(f"window {name} is on {host} with {size} bytes; this rank is on "
                             f"{socket.gethostname()} and expects {total}")
        if not _WINDOW_NAME.fullmatch(name):
            raise ProtocolError(f"rank {me}: refused window name {name!r} from rank 0 (not {PREFIX}<pid>-<token>-w)",
                                rank=me, peer=0)
        fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
            raise ProtocolError(f"rank {me}: refused window {name}: not a regular file of uid {os.getuid()} with "
                                f"mode 600", rank=me, peer=0)
        if st.st_size != total:
            raise UsageError(f"window {name} has {st.st_size} bytes, not {total}")
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, me)
        mm = _map(fd, total)
        if key is not None and not _shm_proof.check(mm, PROOF_AT, key, _CREATOR, name, 0, t.size):
            raise ProtocolError(f"rank {me}: refused window {name}: it does not hold rank 0's proof of the group's "
                                "secret (a file put there by another process, or a rank 0 without the secret)",
                                rank=me, peer=0)
        if key is not None:
            _shm_proof.write(mm, PROOF_AT + 32 * me, key, _ATTACHER, name, me, t.size)
        _set_pid(mm, me, t.size, nbytes)
        answer = _message("OK", "")
    except ProtocolError as exc:
        refused, answer = exc, _message("PR", str(exc))
    except (OSError, UsageError) as exc:
        answer = _message("ER", str(exc))
    try:
        t.send(0, answer, WINDOW_TAG, deadline.remaining())
        # Rank 0 is alive (it sent the name): its answer names whoever did not arrive, once its own wait ends,
        # at this same deadline; GO_GRACE_S past it lets that answer, not this rank's guess, be the error.
        rest = deadline.remaining()
        go = _parse(_recv(t, 0, Deadline(None if rest is None else rest + GO_GRACE_S)))
        if refused is not None:
            raise refused
        if answer[:2] != b"OK":
            raise GradcollError(f"rank {me}: the window could not be set up: {_parse(answer)[1]}")
        if go[0] != "GO":
            _raise(me, *go)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    assert mm is not None
    return _window(mm, fd, me, t.size, getattr(t, "crowd", None))
