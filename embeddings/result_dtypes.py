"""How a job's vectors are stored in the job store: float32 (default) or float16, always read back as float32.

float16 halves a job's result bytes. It keeps 11 significant bits: each stored value is within
2^-11 (about 4.9e-4) of the float32 value relative to it (values below 2^-14, about 6.1e-5, keep
an absolute error of at most 2^-25), so the cosine of a stored unit vector with its float32
original stays above 0.9999998 (README, "Result precision"; measured on real sentences in
tests/api/test_jobs_end_to_end.py). Values beyond ±65504 cannot be stored at all: such a chunk is
refused (ResultOutOfRange) rather than stored as infinity.

A job whose output type is quantised (int8, uint8: one byte a dimension; binary, ubinary: sign bits
packed eight to a byte, embeddings/services/inference/quantization.py) is stored in that type, as
the worker's embedding call returns it, and downloaded in it: float16 applies to float results only
(a quantised type is already smaller than float16, and would gain nothing from it).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from embeddings.errors import EmbedsiteError

# numpy is imported by the functions that code vectors, not here: models.py imports this module's
# names in every process at start-up, and most processes (management commands) never code one.
if TYPE_CHECKING:
    import numpy as np

FLOAT32 = "float32"
FLOAT16 = "float16"
DEFAULT_RESULT_DTYPE = FLOAT32
# The names clients and admins use, and each one's little-endian storage dtype (as numpy spells it).
RESULT_DTYPES: dict[str, str] = {FLOAT32: "<f4", FLOAT16: "<f2"}
RESULT_DTYPE_CHOICES = [(name, name) for name in RESULT_DTYPES]
# What every download of float results returns, whatever their storage.
RETURNED_DTYPE = RESULT_DTYPES[FLOAT32]
# Quantised output types, stored and returned as they are (quantization.OUTPUT_DTYPES); the packed
# ones hold eight dimensions a byte.
QUANTISED_STORAGE: dict[str, str] = {"int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}
PACKED_STORAGE = ("binary", "ubinary")


class ResultOutOfRange(EmbedsiteError, ValueError):
    """A vector value that the job's storage dtype cannot hold (beyond float16's ±65504)."""


def result_storage_name(*, result_dtype: str, output_type: str) -> str:
    """How a job's results are stored: its output type when quantised (result_dtype, float32 or
    float16, applies to float results only), else its result_dtype."""
    return output_type if output_type in QUANTISED_STORAGE else result_dtype


def result_storage_dtype(name: str) -> np.dtype:
    import numpy as np

    try:
        return np.dtype(RESULT_DTYPES.get(name) or QUANTISED_STORAGE[name])
    except KeyError:
        known = ", ".join([*RESULT_DTYPES, *QUANTISED_STORAGE])
        raise ValueError(f"unknown result dtype {name!r}; one of {known}") from None


def result_bytes_per_value(name: str) -> int:
    """Bytes one stored value takes (4 for float32, 2 for float16, 1 for the quantised types,
    whose packed binary values each hold eight dimensions)."""
    return result_storage_dtype(name).itemsize


def result_row_width(name: str, dims: int) -> int:
    """Values one stored `dims`-dimensional vector has: dims, or dims / 8 packed bytes (binary)."""
    return dims // 8 if name in PACKED_STORAGE else dims


def result_row_bytes(name: str, dims: int) -> int:
    """Bytes one stored `dims`-dimensional vector takes (384 dims: float32 1,536, float16 768, int8
    and uint8 384, binary and ubinary 48): what a job's results cost in the job store is inputs x
    this."""
    return result_row_width(name, dims) * result_storage_dtype(name).itemsize


def result_returned_dtype(name: str) -> np.dtype:
    """The dtype downloads give: float32 for float results (float16 widened), else the quantised
    type's own."""
    import numpy as np

    return np.dtype(QUANTISED_STORAGE[name]) if name in QUANTISED_STORAGE else np.dtype(RETURNED_DTYPE)


def result_encode(vectors: np.ndarray, name: str) -> bytes:
    """The vectors as stored: rows x dims little-endian values of the dtype `name`, C order."""
    import numpy as np

    dtype = result_storage_dtype(name)
    if name in QUANTISED_STORAGE:
        # Quantised by the embedding call already: stored as they are, never converted again.
        if vectors.dtype != dtype:
            raise ValueError(f"{name} results are {dtype} vectors, not {vectors.dtype}")
        return np.ascontiguousarray(vectors).tobytes()
    source = np.asarray(vectors, dtype=np.float32)
    with np.errstate(over="ignore"):  # an overflow is found and refused just below
        stored = np.ascontiguousarray(source, dtype=dtype)
    if dtype != RETURNED_DTYPE:
        overflowed = np.isinf(stored) & np.isfinite(source)
        if overflowed.any():
            value = float(source[overflowed].flat[0])
            limit = float(np.finfo(dtype).max)
            raise ResultOutOfRange(
                f"a vector value ({value:g}) is beyond {name}'s range (±{limit:g}); "
                f"submit the job with result_dtype {FLOAT32}"
            )
    return stored.tobytes()


def result_decode(raw: bytes, name: str, dims: int) -> np.ndarray:
    """Stored bytes back as a rows x dims float32 array (exact: every float16 is a float32), or for
    a quantised type as stored (rows x dims, or rows x dims / 8 packed bytes)."""
    import numpy as np

    width = result_row_width(name, dims)
    stored = np.frombuffer(raw, dtype=result_storage_dtype(name)).reshape(-1, width)
    returned = result_returned_dtype(name)
    return stored if stored.dtype == returned else stored.astype(returned)


def base64_rows(vectors: np.ndarray) -> list[str]:
    """Each row as the base64 of its little-endian float32 bytes (`encoding_format: base64`, for
    requests and job downloads alike), straight from the array's buffer; a quantised row (int8,
    uint8: one byte a value) as its own bytes."""
    import numpy as np

    one_byte = vectors.dtype.itemsize == 1 and vectors.dtype.kind in "iu"
    little_endian = np.ascontiguousarray(vectors, dtype=None if one_byte else RETURNED_DTYPE)
    row_bytes = little_endian.shape[1] * little_endian.itemsize
    raw = little_endian.tobytes()
    return [base64.b64encode(raw[i : i + row_bytes]).decode("ascii") for i in range(0, len(raw), row_bytes)]
