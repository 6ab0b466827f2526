"""Arrow IPC gradient encoding: layout, compatibility with the original's files, refusals."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from gradcoll.errors import ProtocolError, UsageError  # noqa: E402
from gradcoll.sync import load_gradient_from_arrow, store_gradient_as_arrow  # noqa: E402

# Files written by arrow-rs's IPC FileWriter (the Rust Arrow the original
# uses), schema index:int32 not null, value:float32 not null, one batch.
# FIVE holds [0.0, 0.1, -2.5, 3e38, -0.0]; EMPTY holds no rows.
ARROW_RS_FIVE = base64.b64decode(
    "QVJST1cxAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAP/////4AAAAEAAA"
    "AAAACgAMAAoACQAEAAoAAAAQAAAAAAEEAAgACAAAAAQACAAAAAQAAAACAAAAXAAAABQAAAAQABYAEAAAAA8ABAAAAAgAEAAAABgA"
    "AAAcAAAAAAAAAxgAAAAAAAYACAAGAAYAAAAAAAEAAAAAAAUAAAB2YWx1ZQAAABAAFAAQAAAADwAEAAAACAAQAAAAGAAAACAAAAAA"
    "AAACHAAAAAgADAAEAAsACAAAACAAAAAAAAABAAAAAAUAAABpbmRleAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAD/////+AAAABAAAAAMABQAEgARAAQACAAMAAAAHAAAAAABAAAAAAAAAAMEAAwAHAAQAAwACAAE"
    "AAwAAACIAAAAPAAAABAAAAAFAAAAAAAAAAAAAAACAAAABQAAAAAAAAAAAAAAAAAAAAUAAAAAAAAAAAAAAAAAAAAAAAAABAAAAAAA"
    "AAAAAAAACQAAAAAAAABAAAAAAAAAABwAAAAAAAAAgAAAAAAAAAAJAAAAAAAAAMAAAAAAAAAAHAAAAAAAAAAEAAQABAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA////////////AAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAP//////////AAAAAAEAAAACAAAAAwAAAAQAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAD///////////8AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAA//////////8AAAAAzczMPQAAIMDmsWF/AAAAgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAP////8AAAAAEAAAAAwAFAASAAwACAAEAAwAAAC4AAAA1AAAABAAAAAAAAQACAAIAAAABAAIAAAABAAAAAIAAABcAAAA"
    "FAAAABAAFgAQAAAADwAEAAAACAAQAAAAGAAAABwAAAAAAAADGAAAAAAABgAIAAYABgAAAAAAAQAAAAAABQAAAHZhbHVlAAAAEAAU"
    "ABAAAAAPAAQAAAAIABAAAAAYAAAAIAAAAAAAAAIcAAAACAAMAAQACwAIAAAAIAAAAAAAAAEAAAAABQAAAGluZGV4AAAAAQAAAEAB"
    "AAAAAAAAAAEAAAAAAAAAAQAAAAAAAAAAAAAAAAAA8AAAAEFSUk9XMQ=="
)
ARROW_RS_EMPTY = base64.b64decode(
    "QVJST1cxAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAP/////4AAAAEAAA"
    "AAAACgAMAAoACQAEAAoAAAAQAAAAAAEEAAgACAAAAAQACAAAAAQAAAACAAAAXAAAABQAAAAQABYAEAAAAA8ABAAAAAgAEAAAABgA"
    "AAAcAAAAAAAAAxgAAAAAAAYACAAGAAYAAAAAAAEAAAAAAAUAAAB2YWx1ZQAAABAAFAAQAAAADwAEAAAACAAQAAAAGAAAACAAAAAA"
    "AAACHAAAAAgADAAEAAsACAAAACAAAAAAAAABAAAAAAUAAABpbmRleAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAD/////uAAAABQAAAAAAAAAAAAKAAwACgAJAAQACgAAABQAAAAAAwQADAAQAAAADAAIAAQADAAA"
    "AHwAAAAwAAAABAAAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAQABAAEAAAAAAAAAAAAAAD/////AAAAABAAAAAM"
    "ABQAEgAMAAgABAAMAAAAuAAAANQAAAAQAAAAAAAEAAgACAAAAAQACAAAAAQAAAACAAAAXAAAABQAAAAQABYAEAAAAA8ABAAAAAgA"
    "EAAAABgAAAAcAAAAAAAAAxgAAAAAAAYACAAGAAYAAAAAAAEAAAAAAAUAAAB2YWx1ZQAAABAAFAAQAAAADwAEAAAACAAQAAAAGAAA"
    "ACAAAAAAAAACHAAAAAgADAAEAAsACAAAACAAAAAAAAABAAAAAAUAAABpbmRleAAAAAEAAABAAQAAAAAAAMAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAPAAAABBUlJPVzE="
)
FIVE = np.array([0.0, 0.1, -2.5, 3.0e38, -0.0], dtype=np.float32)


def _file(*batches: list, schema: pa.Schema) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        for cols in batches:
            w.write_batch(pa.record_batch(cols, schema=schema))
    return sink.getvalue().to_pybytes()


def test_layout_is_the_originals():
    data = store_gradient_as_arrow(FIVE)
    assert data[:6] == b"ARROW1" and data[-6:] == b"ARROW1"  # IPC *file*, not stream
    reader = pa.ipc.open_file(data)
    assert reader.num_record_batches == 1
    assert reader.schema.names == ["index", "value"]
    assert [f.type for f in reader.schema] == [pa.int32(), pa.float32()]
    assert not any(f.nullable for f in reader.schema)
    batch = reader.get_batch(0)
    assert batch.column(0).to_pylist() == [0, 1, 2, 3, 4]
    assert batch.column(1).to_numpy().view(np.uint32).tolist() == FIVE.view(np.uint32).tolist()


@pytest.mark.parametrize("n", [0, 1, 1000, 65_537])
def test_round_trip_is_bit_exact(n):
    v = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    if n:
        v[0] = -0.0
    out = load_gradient_from_arrow(store_gradient_as_arrow(v))
    assert out.dtype == np.float32 and out.flags.writeable
    assert out.view(np.uint32).tolist() == v.view(np.uint32).tolist()


def test_nan_and_inf_survive_the_encoding():
    v = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    assert load_gradient_from_arrow(store_gradient_as_arrow(v)).view(np.uint32).tolist() == v.view(np.uint32).tolist()


def test_reads_files_written_by_arrow_rs():
    assert load_gradient_from_arrow(ARROW_RS_FIVE).view(np.uint32).tolist() == FIVE.view(np.uint32).tolist()
    assert load_gradient_from_arrow(ARROW_RS_EMPTY).size == 0


def test_same_schema_and_batches_as_arrow_rs():
    ours, theirs = pa.ipc.open_file(store_gradient_as_arrow(FIVE)), pa.ipc.open_file(ARROW_RS_FIVE)
    assert ours.schema.equals(theirs.schema)
    assert ours.num_record_batches == theirs.num_record_batches == 1
    assert ours.get_batch(0).equals(theirs.get_batch(0))


def test_several_batches_are_concatenated():
    schema = pa.schema([("index", pa.int32()), ("value", pa.float32())])
    data = _file(
        [pa.array([0, 1], pa.int32()), pa.array([1.0, 2.0], pa.float32())],
        [pa.array([0], pa.int32()), pa.array([3.0], pa.float32())],
        schema=schema,
    )
    assert load_gradient_from_arrow(data).tolist() == [1.0, 2.0, 3.0]


def test_missing_value_column_is_refused():
    schema = pa.schema([("index", pa.int32()), ("grad", pa.float32())])
    data = _file([pa.array([0], pa.int32()), pa.array([1.0], pa.float32())], schema=schema)
    with pytest.raises(ProtocolError, match="missing 'value' column"):
        load_gradient_from_arrow(data)


def test_wrongly_typed_value_column_is_refused():
    schema = pa.schema([("index", pa.int32()), ("value", pa.float64())])
    data = _file([pa.array([0], pa.int32()), pa.array([1.0], pa.float64())], schema=schema)
    with pytest.raises(ProtocolError, match="'value' column is not Float32"):
        load_gradient_from_arrow(data)


def test_nulls_in_value_are_refused():
    schema = pa.schema([("index", pa.int32()), ("value", pa.float32())])
    data = _file([pa.array([0, 1], pa.int32()), pa.array([1.0, None], pa.float32())], schema=schema)
    with pytest.raises(ProtocolError, match="nulls"):
        load_gradient_from_arrow(data)


@pytest.mark.parametrize("junk", [b"", b"ARROW1", b"not arrow at all", ARROW_RS_FIVE[:200], ARROW_RS_FIVE[:-7]])
def test_garbage_raises_protocol_error(junk):
    with pytest.raises(ProtocolError):
        load_gradient_from_arrow(junk)


def test_stream_format_is_not_a_file():
    schema = pa.schema([("index", pa.int32()), ("value", pa.float32())])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(pa.record_batch([pa.array([0], pa.int32()), pa.array([1.0], pa.float32())], schema=schema))
    with pytest.raises(ProtocolError):
        load_gradient_from_arrow(sink.getvalue().to_pybytes())


@pytest.mark.parametrize("bad", [np.zeros((2, 2), np.float32), np.array(["a"]), np.zeros(2, complex), 3.0])
def test_store_refuses_what_is_not_a_real_vector(bad):
    with pytest.raises(UsageError):
        store_gradient_as_arrow(bad)


def test_load_refuses_non_bytes():
    with pytest.raises(UsageError):
        load_gradient_from_arrow(12)
