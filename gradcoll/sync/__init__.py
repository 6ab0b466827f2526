"""Gradient sync service: peers of a session exchange gradients through one service.

The re-creation of ipfrs's ``GradientSyncService`` (docs/sync.md),
made real: peers of a session really exchange gradients, ``min_peers`` and
the timeout are honoured, chunks carry the real peer id and a CRC32, large
gradients are stored as chunked blocks, and the FedAvg aggregate can be
returned. See docs/sync.md.

Layers, each usable alone: Arrow IPC encoding (``gradcoll.sync.arrow``), content-
addressed block stores (``gradcoll.sync.blockstore``, ``gradcoll.sync.manifest``), the
accumulator (``gradcoll.sync.accumulator``), the in-process service (``gradcoll.sync.service``),
and gRPC for peers in other processes (``gradcoll.sync.grpc_server``,
``gradcoll.sync.grpc_client``; imported on first use, so only they need grpcio).
pyarrow is needed only by the functions that encode or decode.
"""

from __future__ import annotations

from typing import Any

from .accumulator import AccumulatorConfig, Aggregation, DistributedGradientAccumulator, aggregate_gradients
from .arrow import load_gradient_from_arrow, store_gradient_as_arrow
from .blockstore import BlockNotFound, BlockStore, CorruptBlock, FileBlockStore, MemoryBlockStore, compute_cid
from .manifest import CHUNK_ELEMENTS, GradientManifest, get_gradient, put_gradient, read_manifest
from .messages import (
    LOCAL_PEER,
    AuthenticationError,
    GradientChunkResponse,
    GradientSyncRequest,
    SyncResult,
    SyncStream,
    SyncSummary,
    reassemble,
    reassemble_all,
)
from .service import GradientSyncService

__all__ = [
    "store_gradient_as_arrow",
    "load_gradient_from_arrow",
    "BlockStore",
    "MemoryBlockStore",
    "FileBlockStore",
    "BlockNotFound",
    "CorruptBlock",
    "compute_cid",
    "CHUNK_ELEMENTS",
    "GradientManifest",
    "put_gradient",
    "get_gradient",
    "read_manifest",
    "Aggregation",
    "AccumulatorConfig",
    "DistributedGradientAccumulator",
    "aggregate_gradients",
    "LOCAL_PEER",
    "GradientSyncRequest",
    "GradientChunkResponse",
    "SyncSummary",
    "SyncResult",
    "SyncStream",
    "AuthenticationError",
    "reassemble",
    "reassemble_all",
    "GradientSyncService",
    "GradientSyncServer",
    "GradientSyncClient",
    "ServerThread",
]

# The gRPC names load grpcio on first use (PEP 562), so the rest of the
# package works where grpcio is not installed.
_LAZY = {
    "GradientSyncServer": "grpc_server",
    "ServerThread": "grpc_server",
    "GradientSyncClient": "grpc_client",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        from ..errors import BackendUnavailable

        raise BackendUnavailable(f"gradcoll.sync.{name} needs grpcio: pip install 'gradcoll[grpc]'") from exc
    return getattr(mod, name)
