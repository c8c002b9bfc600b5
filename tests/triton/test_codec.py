"""Tensor codecs: BYTES and raw numeric (de)serialisation, output pairing, batch splitting."""

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from embeddings.triton import TritonInvalidInput, TritonModelError, codec
from embeddings.triton.protocol import grpc_service_pb2 as pb

pytestmark = pytest.mark.unit

texts_or_bytes = st.lists(st.one_of(st.text(), st.binary()), max_size=20)


def as_bytes(element: str | bytes) -> bytes:
    return element.encode("utf-8") if isinstance(element, str) else element


@given(texts_or_bytes)
def test_bytes_round_trip(elements):
    wire = codec.serialize_bytes_tensor(elements)
    assert codec.deserialize_bytes_tensor(wire) == [as_bytes(e) for e in elements]


@pytest.mark.parametrize(
    "element",
    [
        "",
        " \t\n",
        "héllo wörld, 日本語, 🙂",
        "x" * 1_000_000,
        "ünïcødé " * 50_000,
        b"\xff\xfe\x80 not utf-8 \xc3",
        b"\x00\x00embedded nulls\x00",
    ],
    ids=["empty", "whitespace", "non-ascii", "one-million-chars", "long-non-ascii", "invalid-utf8", "nulls"],
)
def test_bytes_round_trip_edge_cases(element):
    elements = [element, "", element]
    assert codec.deserialize_bytes_tensor(codec.serialize_bytes_tensor(elements)) == [
        as_bytes(e) for e in elements
    ]


def test_bytes_length_prefix_is_4_byte_little_endian():
    assert codec.serialize_bytes_tensor(["abc", ""]) == b"\x03\x00\x00\x00abc" + b"\x00\x00\x00\x00"
    long = "é" * 300  # 600 bytes: the prefix needs two bytes, low byte first
    assert codec.serialize_bytes_tensor([long])[:4] == struct.pack("<I", 600) == b"\x58\x02\x00\x00"


def test_empty_bytes_tensor():
    assert codec.serialize_bytes_tensor([]) == b""
    assert codec.deserialize_bytes_tensor(b"") == []


@pytest.mark.parametrize("wire", [b"\x03\x00", b"\x05\x00\x00\x00abc"], ids=["cut-prefix", "cut-element"])
def test_truncated_bytes_tensor_is_refused(wire):
    with pytest.raises(ValueError, match="BYTES"):
        codec.deserialize_bytes_tensor(wire)


def test_fp32_decode_reads_little_endian_whatever_the_host():
    raw = struct.pack("<6f", 1.5, -2.0, 0.0, 3.25, 1e-7, -1e30)
    decoded = codec.decode_tensor(raw, "FP32", [2, 3])
    assert decoded.shape == (2, 3)
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, np.array([[1.5, -2.0, 0.0], [3.25, 1e-7, -1e30]], np.float32))
    # The same numbers in big-endian order are different bytes, and decode to other values.
    assert not np.array_equal(
        codec.decode_tensor(struct.pack(">6f", 1.5, -2.0, 0.0, 3.25, 1e-7, -1e30), "FP32", [2, 3]), decoded
    )


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=20)))
def test_fp32_round_trip(array):
    datatype, raw = codec.encode_tensor(array)
    assert datatype == "FP32"
    decoded = codec.decode_tensor(raw, datatype, array.shape)
    np.testing.assert_array_equal(decoded, array)


def test_int64_decode_and_wrong_size():
    raw = struct.pack("<3q", -1, 2**40, 7)
    np.testing.assert_array_equal(codec.decode_tensor(raw, "INT64", [3]), [-1, 2**40, 7])
    with pytest.raises(ValueError):
        codec.decode_tensor(raw, "INT64", [2, 2])


def test_bytes_output_decodes_to_object_array_of_bytes():
    raw = codec.serialize_bytes_tensor(["a", b"\xff", ""])
    decoded = codec.decode_tensor(raw, "BYTES", [3, 1])
    assert decoded.shape == (3, 1)
    assert decoded.ravel().tolist() == [b"a", b"\xff", b""]


def test_build_infer_request_uses_raw_contents_in_input_order():
    ids = np.array([[1, 2], [3, 4]], dtype=np.int32)
    texts = np.array([["héllo"], ["x"]], dtype=object)
    request = codec.build_infer_request(
        "m",
        {"input_ids": ids, "text": texts},
        version="2",
        datatypes={"input_ids": "INT64"},
        output_names=["out"],
    )
    assert (request.model_name, request.model_version) == ("m", "2")
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("input_ids", "INT64", [2, 2]),
        ("text", "BYTES", [2, 1]),
    ]
    assert not any(t.HasField("contents") for t in request.inputs)
    assert request.raw_input_contents[0] == np.array([[1, 2], [3, 4]], "<i8").tobytes()
    assert codec.deserialize_bytes_tensor(request.raw_input_contents[1]) == ["héllo".encode(), b"x"]
    assert [o.name for o in request.outputs] == ["out"]


@pytest.mark.parametrize(
    ("array", "datatype"),
    [(np.zeros((1, 2), np.float32), "INT64"), (np.zeros(2, np.int64), "BYTES"), (np.array(["a"]), "FP32")],
)
def test_inputs_are_not_cast_across_kinds(array, datatype):
    with pytest.raises(TritonInvalidInput, match="cannot be sent as"):
        codec.build_infer_request("m", {"x": array}, datatypes={"x": datatype})


def infer_response(outputs: list[tuple[str, np.ndarray]]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name="m")
    for name, array in outputs:
        datatype, raw = codec.encode_tensor(array)
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(raw)
    return response


def test_raw_outputs_are_paired_with_outputs_by_position_then_returned_by_name():
    embedding = np.arange(6, dtype=np.float32).reshape(2, 3)
    counts = np.array([[7], [9]], dtype=np.int64)
    # Triton may list outputs in any order; each raw blob belongs to the output at its index.
    for order in (
        [("embedding", embedding), ("token_count", counts)],
        [("token_count", counts), ("embedding", embedding)],
    ):
        decoded = codec.decode_infer_response(infer_response(order))
        np.testing.assert_array_equal(decoded["embedding"], embedding)
        np.testing.assert_array_equal(decoded["token_count"], counts)
        assert decoded["embedding"].dtype == np.float32
        assert decoded["token_count"].dtype == np.int64


def test_response_with_missing_or_short_raw_output_is_a_model_error():
    response = infer_response([("embedding", np.zeros((2, 3), np.float32))])
    del response.raw_output_contents[:]
    with pytest.raises(TritonModelError, match="1 outputs but 0 raw"):
        codec.decode_infer_response(response)
    response.raw_output_contents.append(b"\x00" * 8)  # 2 floats where 6 are announced
    with pytest.raises(TritonModelError, match="cannot be decoded"):
        codec.decode_infer_response(response)


@given(st.integers(0, 500), st.integers(0, 64))
def test_split_batches_covers_every_row_once_in_order(rows, max_batch_size):
    batches = codec.split_batches(rows, max_batch_size)
    assert [row for batch in batches for row in batch] == list(range(rows))
    if max_batch_size > 0:
        assert all(1 <= len(batch) <= max_batch_size for batch in batches)
        assert len(batches) == -(-rows // max_batch_size)
    else:
        assert len(batches) == (1 if rows else 0)


def test_split_batches_for_100_rows_of_16():
    assert [(b.start, b.stop) for b in codec.split_batches(100, 16)] == [
        (0, 16),
        (16, 32),
        (32, 48),
        (48, 64),
        (64, 80),
        (80, 96),
        (96, 100),
    ]


@given(
    hnp.arrays(
        np.float32, st.tuples(st.integers(1, 80), st.integers(1, 8)), elements=st.floats(-1e6, 1e6, width=32)
    ),
    st.integers(1, 20),
)
def test_split_then_reassemble_restores_rows_in_order(array, max_batch_size):
    inputs = {"x": array, "row": np.arange(len(array))}
    parts = [codec.slice_rows(inputs, batch) for batch in codec.split_batches(len(array), max_batch_size)]
    np.testing.assert_array_equal(codec.reassemble([part["x"] for part in parts]), array)
    np.testing.assert_array_equal(codec.reassemble([part["row"] for part in parts]), np.arange(len(array)))


def test_reassembled_result_is_writable():
    read_only = codec.decode_tensor(np.ones(4, np.float32).tobytes(), "FP32", [2, 2])
    assert not read_only.flags.writeable
    assert codec.reassemble([read_only]).flags.writeable


def test_build_infer_request_carries_a_priority_only_when_asked():
    inputs = {"input_ids": np.ones((1, 2), dtype=np.int64)}
    assert "priority" not in codec.build_infer_request("m", inputs).parameters
    request = codec.build_infer_request("m", inputs, priority=3)
    assert request.parameters["priority"].int64_param == 3
