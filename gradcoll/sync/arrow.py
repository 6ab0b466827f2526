"""Gradients as Arrow IPC files (the original service's encoding).

A gradient of N float32 values is one Arrow IPC *file* (magic ``ARROW1`` at
both ends, schema, one record batch, footer) with two non-nullable columns:
``index: int32`` holding 0..N-1 and ``value: float32`` holding the values.
That is the layout the original writes, so files move both ways: gradcoll
reads the original's files and the original reads gradcoll's. (The exact
flatbuffer bytes and padding are the writer library's choice and differ
between Arrow implementations, even between versions of one; readers do not
depend on them.)

Loading is lenient where the format allows it (several batches are
concatenated, the ``index`` column and any extra columns are ignored, as the
original does) and strict where a silent wrong answer could follow: a
missing ``value`` column, a ``value`` of another type, or nulls in it raise
[`ProtocolError`][gradcoll.errors.ProtocolError].

pyarrow is imported on first use, so ``import gradcoll`` works without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BackendUnavailable, ProtocolError, UsageError

__all__ = ["store_gradient_as_arrow", "load_gradient_from_arrow", "value_views", "gradient_schema", "MAX_ELEMENTS"]

#: The ``index`` column is int32, so one file holds at most this many values.
MAX_ELEMENTS = 2**31 - 1


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401  (submodule used through the package)
    except ImportError as exc:
        raise BackendUnavailable(
            "gradcoll.sync needs pyarrow for the Arrow IPC encoding: pip install 'gradcoll[arrow]'"
        ) from exc
    return pyarrow


def gradient_schema() -> Any:
    """The Arrow schema of a gradient file: ``index: int32 not null, value: float32 not null``."""
    pa = _pyarrow()
    return pa.schema([pa.field("index", pa.int32(), nullable=False), pa.field("value", pa.float32(), nullable=False)])


def _as_float32_vector(values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise UsageError(f"a gradient must be a 1-D vector, got shape {arr.shape}; flatten it first")
    if arr.dtype.kind not in "fiu":
        raise UsageError(f"a gradient must hold real numbers, got dtype {arr.dtype}")
    if arr.size > MAX_ELEMENTS:
        raise UsageError(f"a gradient file holds at most {MAX_ELEMENTS} values (int32 index), got {arr.size}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def store_gradient_as_arrow(values: Any) -> bytes:
    """Encode a 1-D gradient as Arrow IPC file bytes (one batch: ``index``, ``value``)."""
    pa = _pyarrow()
    vec = _as_float32_vector(values)
    schema = gradient_schema()
    # pa.array over a contiguous NumPy array wraps its memory; the only copy
    # is the one the writer makes into the output buffer.
    batch = pa.record_batch(
        [pa.array(np.arange(vec.size, dtype=np.int32)), pa.array(vec)],
        schema=schema,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def load_gradient_from_arrow(data: Any) -> np.ndarray:
    """Decode Arrow IPC file bytes to a new float32 array (batches concatenated).

    Raises [`ProtocolError`][gradcoll.errors.ProtocolError] for bytes that are not an
    Arrow IPC file, or whose ``value`` column is missing, not float32 or
    holds nulls.
    """
    parts = value_views(data)
    if not parts:
        return np.empty(0, dtype=np.float32)
    # concatenate copies, so the result owns writable memory even when the
    # batches are views into the caller's (immutable) bytes.
    return np.concatenate(parts)


def value_views(data: Any) -> list[np.ndarray]:
    """The ``value`` column of each batch as read-only float32 views of ``data`` (no copy)."""
    pa = _pyarrow()
    try:
        buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(memoryview(data))
    except TypeError as exc:
        raise UsageError(f"gradient data must be bytes-like, got {type(data).__name__}") from exc
    parts: list[np.ndarray] = []
    try:
        reader = pa.ipc.open_file(buf)
        col = reader.schema.get_field_index("value")
        if col < 0:
            # get_field_index is also -1 for a duplicated name: both are refused.
            raise ProtocolError("Arrow IPC block missing 'value' column (or it appears more than once)")
        found = reader.schema.field(col).type
        if found != pa.float32():
            raise ProtocolError(f"'value' column is not Float32 (found {found})")
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            batch.validate()  # buffer sizes agree with the lengths; never read past a buffer
            values = batch.column(col)
            if values.null_count:
                raise ProtocolError(f"'value' column holds {values.null_count} nulls in batch {i}")
            parts.append(values.to_numpy(zero_copy_only=True))
    except ProtocolError:
        raise
    except (pa.ArrowException, OSError, ValueError, IndexError) as exc:
        raise ProtocolError(f"not a valid Arrow IPC gradient file ({len(buf)} bytes): {exc}") from exc
    return parts
