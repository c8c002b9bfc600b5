"""A finished job's vectors as download bodies, generated chunk by chunk (constant memory).

Formats: `npy` (one array in input order: float32 rows x dims, rows of failed inputs NaN; for a
quantised output type its own dtype, int8/uint8 rows x dims or binary/ubinary rows x dims / 8,
rows of failed inputs zeros), `jsonl` (one object a line: index, id when the upload had ids,
embedding or error; quantised embeddings as integers, or base64 of their bytes), and the paged
`json` (an OpenAI-style list of a slice).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import orjson

from embeddings.result_dtypes import base64_rows
from embeddings.services.jobs.store import JobStore

NPY_MAGIC = b"\x93NUMPY\x01\x00"
FAILED_INPUT = {"code": "embedding_failed", "message": "this input's chunk failed after retries"}


def npy_header(rows: int, dims: int, dtype: np.dtype | str = "<f4") -> bytes:
    """The .npy (format 1.0) header of a C-order array rows x dims of `dtype` (little-endian
    float32 unless given)."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    header = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({rows}, {dims}), }}"
    # Magic, version and the 2-byte length take 10 bytes; the whole header ends in "\n" on a
    # multiple of 64 bytes, as numpy writes it.
    padding = 64 - (10 + len(header) + 1) % 64
    header += " " * (padding % 64) + "\n"
    return NPY_MAGIC + len(header).to_bytes(2, "little") + header.encode("latin-1")


def npy_size(store: JobStore, rows: int, dims: int) -> int:
    """The .npy file's bytes: its header and rows x the stored type's row bytes."""
    dtype, width = store.result_layout(dims)
    return len(npy_header(rows, width, dtype)) + rows * width * dtype.itemsize


def _chunk_vectors(store: JobStore, chunk: int, rows: int, dims: int) -> tuple[np.ndarray, bool]:
    vectors = store.chunk_result(chunk, dims)
    if vectors is None:
        # NaN where it can be written; integer types have none, so their failed rows are zeros.
        dtype, width = store.result_layout(dims)
        fill = np.nan if dtype.kind == "f" else 0
        return np.full((rows, width), fill, dtype=dtype), False
    return vectors, True


def iter_npy(store: JobStore, chunk_rows: Sequence[int], dims: int) -> Iterator[bytes]:
    """The .npy file: header, then each chunk's bytes as stored."""
    dtype, width = store.result_layout(dims)
    yield npy_header(sum(chunk_rows), width, dtype)
    for chunk, rows in enumerate(chunk_rows):
        vectors, _ = _chunk_vectors(store, chunk, rows, dims)
        yield np.ascontiguousarray(vectors, dtype=dtype).tobytes()


def _embedding(vector: np.ndarray, encoding: str) -> object:
    if encoding == "base64":
        return base64_rows(vector.reshape(1, -1))[0]
    return vector


def _records(
    store: JobStore, chunk_rows: Sequence[int], dims: int, encoding: str, chunks: Iterable[int]
) -> Iterator[dict]:
    starts = np.concatenate([[0], np.cumsum(chunk_rows)]).astype(int)
    for chunk in chunks:
        rows = chunk_rows[chunk]
        vectors, ok = _chunk_vectors(store, chunk, rows, dims)
        ids = store.chunk_ids(chunk)
        for row in range(rows):
            record: dict = {"object": "embedding", "index": int(starts[chunk]) + row}
            if ids is not None:
                record["id"] = ids[row]
            if ok:
                record["embedding"] = _embedding(vectors[row], encoding)
            else:
                record["embedding"] = None
                record["error"] = FAILED_INPUT
            yield record


def iter_jsonl(store: JobStore, chunk_rows: Sequence[int], dims: int, *, encoding: str) -> Iterator[bytes]:
    """One JSON object a line, chunk by chunk (one chunk's lines a piece)."""
    for chunk in range(len(chunk_rows)):
        lines = [
            orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
            for record in _records(store, chunk_rows, dims, encoding, [chunk])
        ]
        yield b"".join(lines)


def json_page(
    store: JobStore, chunk_rows: Sequence[int], dims: int, *, encoding: str, offset: int, limit: int
) -> list[dict]:
    """The records of inputs offset .. offset+limit-1, reading only the chunks that hold them."""
    starts = np.concatenate([[0], np.cumsum(chunk_rows)]).astype(int)
    end = min(offset + limit, int(starts[-1]))
    if offset >= end:
        return []
    first = int(np.searchsorted(starts, offset, side="right")) - 1
    last = int(np.searchsorted(starts, end - 1, side="right")) - 1
    return [
        record
        for record in _records(store, chunk_rows, dims, encoding, range(first, last + 1))
        if offset <= record["index"] < end
    ]
