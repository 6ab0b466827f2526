"""Content-addressed block stores for gradient blocks.

A block's id (its *cid*) is the lowercase hex SHA-256 of its bytes, so a
block is immutable, the same bytes always get the same id, and every read
can prove it returns what was written: both stores hash the bytes on every
``get`` and raise ``CorruptBlock`` rather than return anything else.

``FileBlockStore`` is the embedded default. Each block is one file,
``<root>/<cid[:2]>/<cid>``, written atomically (a temporary file in
``<root>/tmp``, flushed and fsynced, then renamed over the final name; the
directory is fsynced too so the rename survives a crash). Several processes
may share one root: a rename is atomic, so readers see a whole block or
none, and two writers of the same cid write the same bytes. ``delete`` is
not coordinated with writers in other processes; a store shared across
processes should delete only blocks no one can still reference.

Stores refuse blocks over ``max_block_size`` (4 MiB by default); large
gradients are split into chunk blocks under a manifest
(``gradcoll.sync.manifest``), so gradient size is not limited by it.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import GradcollError, ProtocolError, UsageError

__all__ = [
    "BlockStore",
    "MemoryBlockStore",
    "FileBlockStore",
    "BlockNotFound",
    "CorruptBlock",
    "compute_cid",
    "DEFAULT_MAX_BLOCK_SIZE",
]

#: Largest block a store accepts unless told otherwise (a gradient chunk of
#: 65,536 elements is about 0.5 MiB; a manifest of a 2**31-element gradient
#: about 2.3 MiB).
DEFAULT_MAX_BLOCK_SIZE = 4 * 1024 * 1024

_CID = re.compile(r"[0-9a-f]{64}")


class BlockNotFound(GradcollError, KeyError):
    """No block with that cid is in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "block not found"


class CorruptBlock(ProtocolError):
    """A stored block's bytes no longer hash to its cid."""


@runtime_checkable
class BlockStore(Protocol):
    """Content-addressed block storage: the id of a block is the SHA-256 of its bytes."""

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its cid (idempotent)."""
        ...

    def get(self, cid: str) -> bytes:
        """Return the bytes of ``cid``; raise BlockNotFound or CorruptBlock."""
        ...

    def has(self, cid: str) -> bool:
        """True when a block with this cid is stored."""
        ...

    def delete(self, cid: str) -> bool:
        """Remove the block; True if it existed."""
        ...


def compute_cid(data: Any) -> str:
    """The cid of ``data``: its lowercase hex SHA-256."""
    return hashlib.sha256(data).hexdigest()


def _check_cid(cid: Any) -> str:
    # Validating the shape also keeps a hostile cid from naming a path
    # outside the store ("../../etc/passwd" is not 64 hex digits).
    if not isinstance(cid, str) or not _CID.fullmatch(cid):
        raise UsageError(f"a cid is 64 lowercase hex digits (SHA-256), got {cid!r:.80}")
    return cid


def _check_data(data: Any, limit: int | None) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise UsageError(f"a block must be bytes-like, got {type(data).__name__}") from exc
    view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    if limit is not None and view.nbytes > limit:
        raise UsageError(
            f"block of {view.nbytes} bytes exceeds max_block_size={limit}; "
            "store large gradients through gradcoll.sync.put_gradient (chunked under a manifest)"
        )
    return view


def _verified(cid: str, data: bytes, where: str) -> bytes:
    actual = compute_cid(data)
    if actual != cid:
        raise CorruptBlock(f"block {cid} {where} is corrupted: its {len(data)} bytes hash to {actual}")
    return data


class MemoryBlockStore:
    """In-process block store (a dict), thread-safe; for tests and single-process use."""

    def __init__(self, *, max_block_size: int | None = DEFAULT_MAX_BLOCK_SIZE) -> None:
        self.max_block_size = max_block_size
        self._blocks: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its cid (idempotent)."""
        view = _check_data(data, self.max_block_size)
        cid = compute_cid(view)
        with self._lock:
            if cid not in self._blocks:
                self._blocks[cid] = bytes(view)
        return cid

    def get(self, cid: str) -> bytes:
        """Return the bytes of ``cid``, verified against the hash."""
        _check_cid(cid)
        with self._lock:
            data = self._blocks.get(cid)
        if data is None:
            raise BlockNotFound(f"block {cid} is not in the memory store")
        return _verified(cid, data, "in the memory store")

    def has(self, cid: str) -> bool:
        """True when a block with this cid is stored."""
        with self._lock:
            return _check_cid(cid) in self._blocks

    def delete(self, cid: str) -> bool:
        """Remove the block; True if it existed."""
        with self._lock:
            return self._blocks.pop(_check_cid(cid), None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)


class FileBlockStore:
    """Block store in a directory: one file per block, atomic writes, verified reads.

    ``durable=False`` skips the fsyncs (faster; a crash may lose recent
    blocks, but never exposes a partial one, since the rename stays atomic).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_block_size: int | None = DEFAULT_MAX_BLOCK_SIZE,
        durable: bool = True,
    ) -> None:
        self.root = Path(path)
        self.max_block_size = max_block_size
        self.durable = durable
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)  # exist_ok: other processes may race us

    def __repr__(self) -> str:
        return f"FileBlockStore({str(self.root)!r})"

    def _path(self, cid: str) -> Path:
        return self.root / cid[:2] / cid

    def put(self, data: bytes) -> str:
        """Store ``data`` atomically and return its cid (idempotent; heals a corrupted copy)."""
        view = _check_data(data, self.max_block_size)
        cid = compute_cid(view)
        final = self._path(cid)
        try:
            if compute_cid(final.read_bytes()) == cid:
                return cid  # already stored intact (by us or another process)
        except FileNotFoundError:
            pass
        final.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._tmp, prefix=cid[:16] + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(view)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        if self.durable:
            self._fsync_dir(final.parent)
        return cid

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # some platforms cannot open a directory; the rename is still atomic
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def get(self, cid: str) -> bytes:
        """Return the bytes of ``cid``, verified against the hash."""
        path = self._path(_check_cid(cid))
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlockNotFound(f"block {cid} is not in {self.root}") from None
        return _verified(cid, data, f"at {path}")

    def has(self, cid: str) -> bool:
        """True when a block with this cid is stored (not verified: ``get`` does that)."""
        return self._path(_check_cid(cid)).is_file()

    def delete(self, cid: str) -> bool:
        """Remove the block; True if it existed."""
        try:
            self._path(_check_cid(cid)).unlink()
        except FileNotFoundError:
            return False
        return True
