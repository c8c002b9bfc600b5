"""Result storage dtypes: bytes per value, exact float32 round trips, float16's documented precision."""

from __future__ import annotations

import numpy as np
import pytest

from embeddings.result_dtypes import (
    RESULT_DTYPES,
    ResultOutOfRange,
    result_bytes_per_value,
    result_decode,
    result_encode,
    result_row_bytes,
    result_storage_name,
)

pytestmark = pytest.mark.unit

# float16 keeps 11 significant bits: rounding to nearest is within 2^-11 relative to the value.
FLOAT16_RELATIVE_ERROR = 2.0**-11


def unit_vectors(rows: int, dims: int, seed: int = 7) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((rows, dims)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_bytes_per_value_per_dtype():
    assert set(RESULT_DTYPES) == {"float32", "float16"}
    assert result_bytes_per_value("float32") == 4
    assert result_bytes_per_value("float16") == 2
    with pytest.raises(ValueError, match="unknown result dtype 'float64'"):
        result_bytes_per_value("float64")


def test_float32_round_trips_exactly():
    vectors = unit_vectors(5, 384)
    raw = result_encode(vectors, "float32")
    assert len(raw) == 5 * 384 * 4
    decoded = result_decode(raw, "float32", 384)
    assert decoded.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(decoded, vectors)


def test_float16_takes_half_the_bytes_and_reads_back_as_float32():
    vectors = unit_vectors(64, 384)
    raw = result_encode(vectors, "float16")
    assert len(raw) == 64 * 384 * 2
    decoded = result_decode(raw, "float16", 384)
    assert decoded.dtype == np.dtype("<f4") and decoded.shape == (64, 384)
    # Exactly the nearest float16 of each value, widened without loss.
    np.testing.assert_array_equal(decoded, vectors.astype(np.float16).astype(np.float32))
    # Within the documented bound: relative 2^-11 (normal values), plus float16's subnormal
    # spacing's half (2^-25) for the tiniest.
    bound = np.maximum(np.abs(vectors) * FLOAT16_RELATIVE_ERROR, 2.0**-25)
    assert np.all(np.abs(decoded - vectors) <= bound)
    cosine = np.sum(decoded * vectors, axis=1) / (
        np.linalg.norm(decoded, axis=1) * np.linalg.norm(vectors, axis=1)
    )
    assert cosine.min() >= 0.9999998


def test_a_value_float16_cannot_hold_is_refused_not_stored_as_infinity():
    vectors = np.array([[0.5, 65504.0], [1.0, -70000.0]], dtype=np.float32)
    with pytest.raises(ResultOutOfRange, match=r"-70000.*float16.*65504.*float32"):
        result_encode(vectors, "float16")
    # float16's largest value itself fits; float32 storage takes anything.
    assert result_decode(result_encode(vectors[:1], "float16"), "float16", 2)[0, 1] == 65504.0
    np.testing.assert_array_equal(result_decode(result_encode(vectors, "float32"), "float32", 2), vectors)


def test_nan_stays_nan_rather_than_refused():
    # NaN is no overflow: the model's output is stored as it came (as float32 storage does).
    vectors = np.array([[np.nan, 0.25]], dtype=np.float32)
    decoded = result_decode(result_encode(vectors, "float16"), "float16", 2)
    assert np.isnan(decoded[0, 0]) and decoded[0, 1] == 0.25


@pytest.mark.parametrize(
    ("output_type", "dtype", "width", "row_bytes"),
    [
        ("int8", "i1", 384, 384),
        ("uint8", "u1", 384, 384),
        ("binary", "i1", 48, 48),
        ("ubinary", "u1", 48, 48),
    ],
)
def test_quantised_results_are_stored_and_returned_in_their_type(output_type, dtype, width, row_bytes):
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    vectors = rng.integers(info.min, info.max + 1, size=(5, width)).astype(dtype)
    # float16 asked for a quantised job: the output type wins, float16 is for float results only.
    name = result_storage_name(result_dtype="float16", output_type=output_type)
    assert name == output_type
    assert result_row_bytes(name, 384) == row_bytes
    raw = result_encode(vectors, name)
    assert len(raw) == 5 * row_bytes
    decoded = result_decode(raw, name, 384)
    assert decoded.dtype == np.dtype(dtype) and decoded.shape == (5, width)
    np.testing.assert_array_equal(decoded, vectors)


def test_float_results_keep_their_result_dtype():
    assert result_storage_name(result_dtype="float16", output_type="float") == "float16"
    assert result_row_bytes("float32", 384) == 1536
    assert result_row_bytes("float16", 384) == 768


def test_quantised_storage_refuses_float_vectors():
    with pytest.raises(ValueError, match="int8 results are int8 vectors"):
        result_encode(unit_vectors(2, 8), "int8")
