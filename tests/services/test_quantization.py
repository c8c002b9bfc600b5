"""Output types against numpy references written here from their definitions: float as served,
int8/uint8 on calibrated per-dimension ranges, binary/ubinary sign bits packed eight to a byte; and
the calibration as the service reads it from an export."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from embeddings.services.inference.exports import ModelExportMismatch
from embeddings.services.inference.quantization import (
    CALIBRATION_METHOD,
    OUTPUT_TYPES,
    Calibration,
    QuantizationError,
    calibration_from_vectors,
    model_calibration,
    output_bytes,
    quantized,
)

RNG = np.random.default_rng(34)


def unit_rows(rows: int, dims: int) -> np.ndarray:
    vectors = RNG.normal(size=(rows, dims)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


CORPUS = unit_rows(200, 48)
QUERIES = unit_rows(30, 48)
CALIBRATION = calibration_from_vectors(CORPUS)


def reference_bits(vectors: np.ndarray) -> np.ndarray:
    """Sign bits, the first dimension in the highest bit of the first byte, built bit by bit."""
    rows, dims = vectors.shape
    packed = np.zeros((rows, dims // 8), dtype=np.uint8)
    for row in range(rows):
        for dim in range(dims):
            if vectors[row, dim] > 0:
                packed[row, dim // 8] |= 1 << (7 - dim % 8)
    return packed


def reference_codes(vectors: np.ndarray, minimum: np.ndarray, maximum: np.ndarray) -> np.ndarray:
    """int8 codes from the formula, one value at a time in Python floats: one scale for every
    dimension, the largest magnitude the calibration reached."""
    scale = max(max(abs(float(low)), abs(float(high))) for low, high in zip(minimum, maximum, strict=True))
    scale = scale or 1.0
    codes = np.zeros(vectors.shape, dtype=np.int64)
    for (row, dim), value in np.ndenumerate(vectors):
        codes[row, dim] = min(127, max(-127, round(float(value) * 127 / scale)))
    return codes


def test_output_types_are_cohere_s():
    assert OUTPUT_TYPES == ("float", "int8", "uint8", "binary", "ubinary")


def test_float_is_the_vectors_as_float32():
    result = quantized(QUERIES.astype(np.float64), "float", None)
    assert result.dtype == np.float32 and result.flags.c_contiguous
    np.testing.assert_array_equal(result, QUERIES)


def test_ubinary_and_binary_are_the_sign_bits_packed_bit_exactly():
    vectors = np.concatenate([QUERIES, np.zeros((1, 48), np.float32), -np.ones((1, 48), np.float32)])
    bits = reference_bits(vectors)

    ubinary = quantized(vectors, "ubinary", None)
    assert (ubinary.dtype, ubinary.shape) == (np.uint8, (32, 6))
    np.testing.assert_array_equal(ubinary, bits)
    binary = quantized(vectors, "binary", CALIBRATION)  # a calibration is not needed, nor used
    assert (binary.dtype, binary.shape) == (np.int8, (32, 6))
    np.testing.assert_array_equal(binary.astype(np.int16), bits.astype(np.int16) - 128)
    assert ubinary[-2:].max() == 0 and binary[-2:].max() == -128, "zero is not positive"


def test_binary_of_a_hand_worked_vector():
    vector = np.array([[0.5, -0.1, 0.0, 0.2, -0.3, 0.1, 0.1, -1.0, 1.0] + [-1.0] * 7], dtype=np.float32)
    # 1 0 0 1 0 1 1 0 = 0x96 = 150; then 1 followed by seven 0s = 128.
    assert quantized(vector, "ubinary", None).tolist() == [[150, 128]]
    assert quantized(vector, "binary", None).tolist() == [[22, 0]]


def test_uint8_and_int8_follow_the_formula_exactly():
    expected = reference_codes(QUERIES, CALIBRATION.minimum, CALIBRATION.maximum)

    int8 = quantized(QUERIES, "int8", CALIBRATION)
    assert (int8.dtype, int8.shape) == (np.int8, QUERIES.shape)
    np.testing.assert_array_equal(int8, expected)
    uint8 = quantized(QUERIES, "uint8", CALIBRATION)
    assert (uint8.dtype, uint8.shape) == (np.uint8, QUERIES.shape)
    np.testing.assert_array_equal(uint8, expected + 128)


def test_int8_and_uint8_dequantise_to_within_one_step():
    """Inside the calibrated range, a code times the step is within half a step of the float value
    (one step is the promise); zero is a code."""
    inside = np.clip(QUERIES, -CALIBRATION.scale, CALIBRATION.scale)
    step = CALIBRATION.scale / 127
    for output_type, offset in (("int8", 0), ("uint8", -128)):
        codes = quantized(inside, output_type, CALIBRATION).astype(np.float64) + offset
        assert (np.abs(codes * step - inside) <= step * 0.5 + 1e-7).all(), output_type
    assert quantized(np.zeros((1, 48), np.float32), "int8", CALIBRATION).max() == 0


def test_int8_dot_products_rank_as_the_float_ones_do():
    """One scale for every dimension: the integer dot product is the float one times a constant,
    rounding aside, so the order of documents for a query holds wherever scores differ by more
    than rounding can move them."""
    documents = QUERIES[1:]
    codes = quantized(QUERIES, "int8", CALIBRATION).astype(np.int64)
    floats = documents @ QUERIES[0]
    integers = codes[1:] @ codes[0]
    step = CALIBRATION.scale / 127
    scaled = integers * step * step
    # Each product's rounding error is at most about |q| |d| step: far below the scores' spread.
    assert np.abs(scaled - floats).max() < 48 * step
    apart = np.abs(floats[:, None] - floats[None, :]) > 2 * 48 * step
    assert (np.sign(floats[:, None] - floats[None, :]) == np.sign(integers[:, None] - integers[None, :]))[
        apart
    ].all()


def test_the_calibration_ends_take_the_end_codes_and_values_beyond_them_clip():
    calibration = Calibration(minimum=np.array([-0.5, 0.0]), maximum=np.array([0.5, 1.0]))  # scale 1
    vectors = np.array([[-0.5, 0.0], [0.5, 1.0], [-3.0, -0.2], [9.0, 1.5], [0.1, 0.2]], dtype=np.float32)

    int8 = [[-64, 0], [64, 127], [-127, -25], [127, 127], [13, 25]]
    assert quantized(vectors, "int8", calibration).tolist() == int8
    assert quantized(vectors, "uint8", calibration).tolist() == [[a + 128, b + 128] for a, b in int8]


def test_an_empty_range_divides_nothing_by_zero():
    calibration = Calibration(minimum=np.array([0.0, 0.0]), maximum=np.array([0.0, 0.0]))
    vectors = np.array([[0.25, 0.5], [0.0, 1.0], [3.0, -1.0]], dtype=np.float32)

    with np.errstate(all="raise"):
        int8 = quantized(vectors, "int8", calibration)
        uint8 = quantized(vectors, "uint8", calibration)
    # No magnitude seen at all: scale 1, so values keep their size in steps of 1/127.
    assert calibration.scale == 1.0
    assert int8.tolist() == [[32, 64], [0, 127], [127, -127]]
    assert uint8.tolist() == [[160, 192], [128, 255], [255, 1]]


@pytest.mark.parametrize("output_type", ["binary", "ubinary"])
@pytest.mark.parametrize("dims", [1, 7, 12, 383])
def test_binary_types_refuse_a_width_that_is_not_a_multiple_of_8(output_type, dims):
    with pytest.raises(QuantizationError, match=f"{dims} dimensions is not a multiple of 8"):
        quantized(unit_rows(2, dims), output_type, None)
    with pytest.raises(QuantizationError, match="not a multiple of 8"):
        output_bytes(output_type, dims)


@pytest.mark.parametrize("output_type", ["int8", "uint8"])
def test_int8_and_uint8_refuse_to_guess_without_a_calibration_of_their_width(output_type):
    with pytest.raises(
        QuantizationError, match=f"{output_type} embeddings need the model's calibrated ranges"
    ):
        quantized(QUERIES, output_type, None)
    with pytest.raises(QuantizationError, match="the calibration has 48 dimensions, the vectors 16"):
        quantized(QUERIES[:, :16], output_type, CALIBRATION)


def test_an_unknown_type_is_refused():
    with pytest.raises(QuantizationError, match="unknown output type 'base64'"):
        quantized(QUERIES, "base64", None)
    with pytest.raises(QuantizationError, match="unknown output type"):
        output_bytes("int4", 384)
    assert issubclass(QuantizationError, ValueError)


def test_bytes_per_vector():
    assert {output_type: output_bytes(output_type, 384) for output_type in OUTPUT_TYPES} == {
        "float": 1536,
        "int8": 384,
        "uint8": 384,
        "binary": 48,
        "ubinary": 48,
    }
    for output_type in OUTPUT_TYPES:
        assert quantized(QUERIES, output_type, CALIBRATION)[0].nbytes == output_bytes(output_type, 48)


def test_a_calibration_is_the_per_dimension_range():
    vectors = np.array([[1.0, -2.0, 0.5], [3.0, 0.0, 0.5], [-1.0, 4.0, 0.5]], dtype=np.float32)
    calibration = calibration_from_vectors(vectors)
    assert calibration.minimum.tolist() == [-1.0, -2.0, 0.5]
    assert calibration.maximum.tolist() == [3.0, 4.0, 0.5]
    assert calibration.minimum.dtype == np.float32 and calibration.dims == 3
    with pytest.raises(ValueError):
        calibration.minimum[0] = 0.0  # shared through the cache: read-only


def test_a_truncated_calibration_is_of_the_renormalised_prefix():
    """What a request for 16 dimensions gets: the first 16 values, renormalised to unit length,
    whose range is wider than the full vectors' first 16 dimensions'."""
    calibration = calibration_from_vectors(CORPUS, dimensions=16)
    prefix = CORPUS[:, :16].astype(np.float64)
    renormalised = prefix / np.linalg.norm(prefix, axis=1, keepdims=True)
    np.testing.assert_allclose(calibration.minimum, renormalised.min(axis=0), rtol=1e-6)
    np.testing.assert_allclose(calibration.maximum, renormalised.max(axis=0), rtol=1e-6)
    assert (calibration.maximum > CALIBRATION.maximum[:16]).all()

    plain = calibration_from_vectors(CORPUS, dimensions=16, normalize=False)
    np.testing.assert_array_equal(plain.maximum, CORPUS[:, :16].max(axis=0))
    with pytest.raises(QuantizationError, match="have 48 dimensions; cannot calibrate 49"):
        calibration_from_vectors(CORPUS, dimensions=49)


def write_calibrated_export(
    repository: Path, version: int = 1, *, vectors: np.ndarray = CORPUS, record: bool = True
) -> Path:
    """A finished export of `minilm` with calibration vectors and their record."""
    version_dir = repository / "minilm" / str(version)
    version_dir.mkdir(parents=True)
    (version_dir / "model.onnx").write_bytes(b"stand-in")
    (version_dir / "tokenizer.json").write_text("{}")
    buffer = io.BytesIO()
    np.save(buffer, vectors)
    (version_dir / "calibration.npy").write_bytes(buffer.getvalue())
    info = {"name": "minilm", "version": version, "dims": vectors.shape[1]}
    if record:
        info["quantization"] = {
            "corpus": "calibration.txt",
            "texts": len(vectors),
            "vectors": "calibration.npy",
            "vectors_sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
            "method": CALIBRATION_METHOD,
        }
    (version_dir / "export.json").write_text(json.dumps(info))
    return version_dir


def test_a_model_s_calibration_is_read_from_its_export(tmp_path):
    write_calibrated_export(tmp_path, 1, vectors=CORPUS[:100])
    write_calibrated_export(tmp_path, 2)

    for version in ("", "2", 2):
        calibration = model_calibration(tmp_path, "minilm", version, dimensions=None, normalize=True)
        np.testing.assert_array_equal(calibration.minimum, CALIBRATION.minimum)
        np.testing.assert_array_equal(calibration.maximum, CALIBRATION.maximum)
    first = model_calibration(tmp_path, "minilm", "1", dimensions=None, normalize=True)
    np.testing.assert_array_equal(first.maximum, CORPUS[:100].max(axis=0))
    truncated = model_calibration(tmp_path, "minilm", "", dimensions=16, normalize=True)
    expected = calibration_from_vectors(CORPUS, dimensions=16)
    np.testing.assert_array_equal(truncated.maximum, expected.maximum)


def test_a_calibration_is_loaded_once_per_file_version_and_width(tmp_path, monkeypatch):
    version_dir = write_calibrated_export(tmp_path)
    loads = []
    load = np.load
    monkeypatch.setattr(np, "load", lambda *args, **kwargs: loads.append(1) or load(*args, **kwargs))

    first = model_calibration(tmp_path, "minilm", "", dimensions=None, normalize=True)
    assert model_calibration(tmp_path, "minilm", "", dimensions=None, normalize=True) is first
    model_calibration(tmp_path, "minilm", "", dimensions=24, normalize=True)
    model_calibration(tmp_path, "minilm", "", dimensions=24, normalize=False)
    assert len(loads) == 3

    # A re-export writes other vectors (and records them): read again.
    shutil.rmtree(version_dir)
    write_calibrated_export(tmp_path, vectors=-CORPUS)
    again = model_calibration(tmp_path, "minilm", "", dimensions=None, normalize=True)
    np.testing.assert_array_equal(again.maximum, -CALIBRATION.minimum)
    assert len(loads) == 4


def test_an_export_without_calibration_has_none(tmp_path):
    assert model_calibration(tmp_path, "minilm", "", dimensions=None, normalize=True) is None
    write_calibrated_export(tmp_path, record=False)
    assert model_calibration(tmp_path, "minilm", "", dimensions=None, normalize=True) is None
    assert model_calibration(tmp_path, "minilm", "1", dimensions=8, normalize=True) is None
    assert model_calibration(tmp_path, "minilm", "3", dimensions=8, normalize=True) is None


def test_recorded_vectors_that_are_missing_or_replaced_are_a_broken_export(tmp_path):
    version_dir = write_calibrated_export(tmp_path)
    np.save(version_dir / "calibration.npy", CORPUS * 2)
    with pytest.raises(ModelExportMismatch, match=r"is not the calibration its export\.json records"):
        model_calibration(tmp_path, "minilm", "", dimensions=None, normalize=True)
    (version_dir / "calibration.npy").unlink()
    with pytest.raises(ModelExportMismatch, match=r"calibration\.npy is missing"):
        model_calibration(tmp_path, "minilm", "", dimensions=None, normalize=True)


def test_more_dimensions_than_the_model_has_are_refused(tmp_path):
    write_calibrated_export(tmp_path)
    with pytest.raises(QuantizationError, match="cannot calibrate 64"):
        model_calibration(tmp_path, "minilm", "", dimensions=64, normalize=True)
