"""Chunked gradient storage: chunk blocks under a manifest block.

A gradient of N values is stored as ``max(1, ceil(N / chunk_elements))``
chunk blocks, each an Arrow IPC gradient file of at most ``chunk_elements``
values (whose ``index`` column restarts at 0, as in the original's stream
chunks), plus one manifest block listing the chunk cids in order. The
manifest's cid names the whole gradient. Chunks are exactly what the sync
service streams, so streaming a stored gradient re-encodes nothing, and no
block is ever larger than about 8 bytes x ``chunk_elements``: there is no
ceiling on the gradient's size (the original stored one block per gradient
and failed above about 260k elements).

Manifest bytes: ``b"gradcoll-manifest/1\\n"`` followed by compact JSON
``{"elements": N, "chunk_elements": C, "chunks": [cid, ...]}``.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError, UsageError
from .arrow import _as_float32_vector, load_gradient_from_arrow, store_gradient_as_arrow
from .blockstore import BlockStore, _check_cid

__all__ = ["CHUNK_ELEMENTS", "GradientManifest", "put_gradient", "write_gradient", "read_manifest", "get_gradient"]

#: Elements per streamed chunk and per stored chunk block (the original's 65,536).
CHUNK_ELEMENTS = 65_536

_MAGIC = b"gradcoll-manifest/1\n"


def chunk_count(elements: int, chunk_elements: int) -> int:
    """Chunks for ``elements`` values: ceil(elements / chunk_elements), and 1 for an empty gradient."""
    return max(1, -(-elements // chunk_elements))


@dataclass(frozen=True)
class GradientManifest:
    """The chunk cids of one stored gradient, in order."""

    elements: int
    chunk_elements: int
    chunks: tuple[str, ...]

    def __post_init__(self) -> None:
        if not _is_count(self.elements) or not _is_count(self.chunk_elements) or self.chunk_elements < 1:
            raise ProtocolError(
                f"manifest: elements={self.elements!r}, chunk_elements={self.chunk_elements!r} are not valid counts"
            )
        want = chunk_count(self.elements, self.chunk_elements)
        if len(self.chunks) != want:
            raise ProtocolError(
                f"manifest: {self.elements} elements in chunks of {self.chunk_elements} need {want} chunks, "
                f"it lists {len(self.chunks)}"
            )
        for cid in self.chunks:
            try:
                _check_cid(cid)
            except UsageError as exc:
                raise ProtocolError(f"manifest lists an invalid chunk cid: {exc}") from None

    def chunk_length(self, i: int) -> int:
        """Number of values in chunk ``i``."""
        return max(0, min(self.chunk_elements, self.elements - i * self.chunk_elements))

    def encode(self) -> bytes:
        """The manifest block's bytes."""
        body = {"elements": self.elements, "chunk_elements": self.chunk_elements, "chunks": list(self.chunks)}
        return _MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> GradientManifest:
        """Parse manifest bytes; raise ProtocolError for anything else."""
        if not bytes(data[: len(_MAGIC)]) == _MAGIC:
            raise ProtocolError("block is not a gradcoll gradient manifest (bad magic)")
        try:
            body = json.loads(bytes(data[len(_MAGIC) :]))
            chunks = body["chunks"]
            if not isinstance(chunks, list):
                raise TypeError("chunks is not a list")
            return cls(body["elements"], body["chunk_elements"], tuple(chunks))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed gradient manifest: {exc}") from None


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def put_gradient(store: BlockStore, values: Any, *, chunk_elements: int = CHUNK_ELEMENTS) -> str:
    """Store a 1-D gradient as chunk blocks plus a manifest; return the manifest's cid."""
    return write_gradient(store, values, chunk_elements=chunk_elements)[0]


def write_gradient(
    store: BlockStore, values: Any, *, chunk_elements: int = CHUNK_ELEMENTS
) -> tuple[str, GradientManifest, tuple[int, ...]]:
    """Like ``put_gradient``, also returning the manifest and each chunk's CRC32."""
    if not _is_count(chunk_elements) or chunk_elements < 1:
        raise UsageError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
    vec = _as_float32_vector(values)
    n = vec.size
    cids, crcs = [], []
    for i in range(chunk_count(n, chunk_elements)):
        data = store_gradient_as_arrow(vec[i * chunk_elements : (i + 1) * chunk_elements])
        cids.append(store.put(data))
        crcs.append(zlib.crc32(data))
    manifest = GradientManifest(n, chunk_elements, tuple(cids))
    # The manifest goes in last: whoever can read it can read every chunk.
    return store.put(manifest.encode()), manifest, tuple(crcs)


def read_manifest(store: BlockStore, cid: str) -> GradientManifest:
    """Fetch and parse the manifest block ``cid``."""
    try:
        return GradientManifest.decode(store.get(cid))
    except ProtocolError as exc:
        raise type(exc)(f"block {cid}: {exc}") from exc


def get_gradient(store: BlockStore, cid: str) -> np.ndarray:
    """Rebuild the gradient stored under manifest ``cid`` (every block hash-verified)."""
    manifest = read_manifest(store, cid)
    out = np.empty(manifest.elements, dtype=np.float32)
    for i, chunk_cid in enumerate(manifest.chunks):
        part = load_gradient_from_arrow(store.get(chunk_cid))
        want = manifest.chunk_length(i)
        if part.size != want:
            raise ProtocolError(
                f"gradient {cid}: chunk {i}/{len(manifest.chunks)} holds {part.size} values, the manifest says {want}"
            )
        start = i * manifest.chunk_elements
        out[start : start + want] = part
    return out
