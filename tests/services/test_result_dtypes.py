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
