"""API parity with the original GradientSyncService: names, field order, types and units.

Written from the original's documented API (its request and response
structs, the service's constructor and ``sync_gradients``), not from
gradcoll's behaviour. Where gradcoll departs on purpose, the test pins the
departure that docs/sync.md states.
"""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="pyarrow not installed: pip install 'gradcoll[arrow]'")

from gradcoll.sync import (
    GradientChunkResponse,
    GradientSyncRequest,
    GradientSyncService,
    MemoryBlockStore,
    SyncSummary,
    load_gradient_from_arrow,
    store_gradient_as_arrow,
)
from tests.helpers import field_names, positional_params


def test_request_and_response_fields_in_the_originals_order() -> None:
    assert field_names(GradientSyncRequest)[:4] == ["session_id", "local_gradient", "min_peers", "timeout_secs"]
    assert field_names(GradientChunkResponse)[:5] == ["session_id", "chunk_index", "total_chunks", "data", "peer_id"]


def test_a_request_is_built_as_in_the_original_with_whole_seconds() -> None:
    gradient = store_gradient_as_arrow([i * 0.01 for i in range(256)])
    req = GradientSyncRequest("round-1", gradient, 0, 30)  # session_id, local_gradient, min_peers, timeout_secs
    assert (req.session_id, req.min_peers, req.timeout_secs) == ("round-1", 0, 30)
    assert type(req.timeout_secs) is int  # seconds, as given (a float of seconds is accepted too)
    assert GradientSyncRequest("r", gradient, 0, 0.5).timeout_secs == 0.5


def test_a_response_is_built_from_the_originals_fivefield_names() -> None:
    data = store_gradient_as_arrow([1.0, 2.0])
    chunk = GradientChunkResponse("s", 0, 1, data, "local")
    assert chunk.checksum == zlib.crc32(data)  # gradcoll's addition, computed when not given
    chunk.verify()
    assert GradientChunkResponse("s", 0, 1, data, "local", chunk.checksum) == chunk


def test_service_is_built_from_a_store_and_sync_gradients_takes_request_then_channel() -> None:
    assert positional_params(GradientSyncService) == ["store"]
    assert positional_params(GradientSyncService.sync_gradients) == ["request", "sink"]


async def _sync(values: np.ndarray, session: str) -> tuple[list[GradientChunkResponse], SyncSummary]:
    service = GradientSyncService(MemoryBlockStore())
    req = GradientSyncRequest(session, store_gradient_as_arrow(values), 0, 5)
    channel: asyncio.Queue[GradientChunkResponse | None] = asyncio.Queue(64)
    summary = await service.sync_gradients(req, channel)
    got = []
    # The original's receiver loops until the channel closes; gradcoll ends the stream with None.
    while (chunk := await channel.get()) is not None:
        got.append(chunk)
    assert channel.empty()
    return got, summary


@pytest.mark.parametrize("n, chunks", [(0, 1), (128, 1), (131_072, 2)])
def test_chunks_of_65536_elements_streamed_as_local(n: int, chunks: int) -> None:
    values = (np.arange(n, dtype=np.float32) * 1e-5).astype(np.float32)
    got, summary = asyncio.run(_sync(values, f"parity-{n}"))
    assert len(got) == chunks
    assert [c.chunk_index for c in got] == list(range(chunks))
    assert all(c.total_chunks == chunks and c.peer_id == "local" and c.session_id == f"parity-{n}" for c in got)
    assert all(type(c.chunk_index) is int and type(c.total_chunks) is int for c in got)
    assert all(len(c.data) > 0 for c in got)  # Arrow IPC bytes, even for the empty gradient
    back = np.concatenate([load_gradient_from_arrow(c.data) for c in got])
    np.testing.assert_array_equal(back, values)
    # Documented departure: the call returns a summary instead of nothing.
    assert isinstance(summary, SyncSummary) and summary.elements == n
