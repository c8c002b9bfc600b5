"""Job downloads: .npy readable by numpy, JSONL and paged JSON in input order, failed rows marked."""

from __future__ import annotations

import base64
import io

import numpy as np
import orjson
import pytest

from embeddings.redis.connections import redis_job_store
from embeddings.services.jobs.results import iter_jsonl, iter_npy, json_page, npy_header
from embeddings.services.jobs.store import JobStore

DIMS = 3
CHUNK_ROWS = [2, 2, 1]  # five inputs in three chunks; chunk 1 failed


@pytest.fixture
def store(service_redis) -> JobStore:
    store = JobStore(redis_job_store(), "job_results", ttl_s=600)
    store.put_inputs([["a", "b"], ["c", "d"], ["e"]], ids=[["id-a", "id-b"], ["id-c", "id-d"], ["id-e"]])
    store.finish_chunk(0, expected_rows(0, 2), tokens=4)
    store.fail_chunk(1, rows=2)
    store.finish_chunk(2, expected_rows(4, 1), tokens=2)
    return store


def expected_rows(first: int, count: int) -> np.ndarray:
    return np.array([[index, index + 0.5, -index] for index in range(first, first + count)], dtype=np.float32)


@pytest.mark.parametrize(("rows", "dims"), [(0, 384), (1, 1), (5, 3), (100_000, 16), (7, 12345)])
def test_npy_header_is_what_numpy_reads(rows, dims):
    header = npy_header(rows, dims)
    assert len(header) % 64 == 0
    array = np.load(io.BytesIO(header + np.zeros((rows, dims), dtype="<f4").tobytes()))
    assert array.shape == (rows, dims) and array.dtype == np.dtype("<f4")


def test_npy_download_has_every_row_in_order_with_nan_for_failures(store):
    array = np.load(io.BytesIO(b"".join(iter_npy(store, CHUNK_ROWS, DIMS))))
    assert array.shape == (5, DIMS)
    np.testing.assert_array_equal(array[:2], expected_rows(0, 2))
    assert np.isnan(array[2:4]).all()
    np.testing.assert_array_equal(array[4:], expected_rows(4, 1))


def test_npy_streams_one_chunk_a_piece(store):
    pieces = list(iter_npy(store, CHUNK_ROWS, DIMS))
    assert len(pieces) == 1 + len(CHUNK_ROWS)


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_jsonl_lines(store, encoding):
    body = b"".join(iter_jsonl(store, CHUNK_ROWS, DIMS, encoding=encoding))
    records = [orjson.loads(line) for line in body.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["id"] for r in records] == ["id-a", "id-b", "id-c", "id-d", "id-e"]
    assert records[2]["embedding"] is None and records[2]["error"]["code"] == "embedding_failed"

    def vector(record) -> np.ndarray:
        if encoding == "base64":
            return np.frombuffer(base64.b64decode(record["embedding"]), dtype="<f4")
        return np.array(record["embedding"], dtype=np.float32)

    np.testing.assert_array_equal(vector(records[1]), expected_rows(1, 1)[0])
    np.testing.assert_array_equal(vector(records[4]), expected_rows(4, 1)[0])


@pytest.mark.parametrize(
    ("offset", "limit", "indexes"),
    [(0, 2, [0, 1]), (1, 3, [1, 2, 3]), (3, 10, [3, 4]), (4, 1, [4]), (5, 10, []), (0, 100, [0, 1, 2, 3, 4])],
)
def test_json_pages(store, offset, limit, indexes):
    page = json_page(store, CHUNK_ROWS, DIMS, encoding="float", offset=offset, limit=limit)
    assert [record["index"] for record in page] == indexes


QUANTISED_DIMS = 16


@pytest.mark.parametrize(
    ("output_type", "dtype", "width"),
    [("int8", "i1", 16), ("uint8", "u1", 16), ("binary", "i1", 2), ("ubinary", "u1", 2)],
)
def test_quantised_downloads_in_their_type(service_redis, output_type, dtype, width):
    store = JobStore(redis_job_store(), f"job_q_{output_type}", ttl_s=600, result_dtype=output_type)
    store.put_inputs([["a", "b"], ["c"]])
    written = np.arange(-4, -4 + 2 * width).reshape(2, width).astype(dtype)
    store.finish_chunk(0, written, tokens=2)
    store.fail_chunk(1, rows=1)
    raw = b"".join(iter_npy(store, [2, 1], QUANTISED_DIMS))
    assert len(raw) == len(npy_header(3, width, dtype)) + 3 * width
    array = np.load(io.BytesIO(raw))
    assert array.dtype == np.dtype(dtype) and array.shape == (3, width)
    np.testing.assert_array_equal(array[:2], written)
    assert not array[2].any()  # a failed input: zeros, integers having no NaN

    lines = [
        orjson.loads(line)
        for line in b"".join(iter_jsonl(store, [2, 1], QUANTISED_DIMS, encoding="float")).splitlines()
    ]
    assert lines[1]["embedding"] == written[1].tolist()
    assert lines[2]["embedding"] is None
    encoded = json_page(store, [2, 1], QUANTISED_DIMS, encoding="base64", offset=0, limit=1)
    assert base64.b64decode(encoded[0]["embedding"]) == written[0].tobytes()
