"""Embeddings in the types retrieval engines store: float32 as served, int8 and uint8 (one byte a
dimension, its range calibrated at export), binary and ubinary (sign bits, eight to a byte).

int8 scales every dimension by one factor, 127 / the largest magnitude any dimension reached on the
calibration corpus, rounds to the nearest code and clips to [-127, 127]; uint8 is the same code
plus 128. The ranges are the per-dimension minimum and maximum of the model's vectors of the
calibration corpus (embeddings/tooling/calibration/), which the export saves beside model.onnx as
calibration.npy and records in export.json ("quantization"), computed at the width a request asks
for (a truncated, Matryoshka, renormalised vector's values spread wider than the full vector's).
One zero-centred scale, rather than sentence-transformers' per-dimension [minimum, maximum] onto
256 codes, because retrieval engines rank int8 vectors by their integer dot product: with one
scale that product is the float one times a constant, rounding aside, so the vectors rank as the
float ones do (bench/quantization.py on MiniLM's held-out texts: recall@10 against float 0.993;
per-dimension ranges 0.818, per-dimension zero-centred scales 0.915).

binary and ubinary need no calibration: the bit of a dimension is 1 where its value is positive,
packed big-end first (numpy's packbits, as Cohere and sentence-transformers pack them); binary is
the same bytes as signed int8 less 128.

Pure numpy; reads the export's files, never Django's settings (the caller names the repository).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embeddings.errors import EmbedsiteError
from embeddings.model_tasks import OUTPUT_TYPES
from embeddings.services.inference.exports import (
    EXPORT_INFO_FILENAME,
    ModelExportMismatch,
    model_export_latest,
    model_export_version_dir,
)

FLOAT = "float"
INT8 = "int8"
UINT8 = "uint8"
BINARY = "binary"
UBINARY = "ubinary"
# What the calibrated types need: the others are computed from the vector alone.
CALIBRATED_TYPES = (INT8, UINT8)
PACKED_TYPES = (BINARY, UBINARY)
# Each type's element as numpy spells it (little-endian where it matters), for NPY files and sizes.
OUTPUT_DTYPES: dict[str, str] = {FLOAT: "<f4", INT8: "i1", UINT8: "u1", BINARY: "i1", UBINARY: "u1"}

# export.json's "quantization" record says this of how the ranges are computed.
CALIBRATION_METHOD = (
    "per-dimension min/max over the calibration corpus; int8 = round(v * 127 / the largest magnitude "
    "of any dimension), uint8 = int8 + 128"
)
QUANTIZATION_RECORD = "quantization"
INT8_LIMIT = 127  # codes -127..127: symmetric, so that zero is a code and negation is exact


class QuantizationError(EmbedsiteError, ValueError):
    """Vectors that cannot be given in the type asked for: an unknown type, a width that binary
    types cannot pack, int8/uint8 without a calibration of that width."""


@dataclass(frozen=True, eq=False)
class Calibration:
    """Per-dimension ranges for int8/uint8: `minimum` and `maximum` (float32, [dims], read-only)."""

    minimum: np.ndarray
    maximum: np.ndarray

    def __post_init__(self) -> None:
        minimum = np.array(self.minimum, dtype=np.float32)
        maximum = np.array(self.maximum, dtype=np.float32)
        if minimum.ndim != 1 or minimum.shape != maximum.shape or not minimum.size:
            raise QuantizationError(
                f"a calibration has one minimum and one maximum a dimension, not shapes {minimum.shape} "
                f"and {maximum.shape}"
            )
        if not (np.isfinite(minimum).all() and np.isfinite(maximum).all() and (minimum <= maximum).all()):
            raise QuantizationError("a calibration's ranges are finite, each minimum at most its maximum")
        minimum.setflags(write=False)  # shared by every request through the cache
        maximum.setflags(write=False)
        object.__setattr__(self, "minimum", minimum)
        object.__setattr__(self, "maximum", maximum)

    @property
    def dims(self) -> int:
        return int(self.minimum.shape[0])

    @property
    def scale(self) -> float:
        """The largest magnitude any dimension reached (1 where every range is 0): int8's 127."""
        largest = float(max(np.abs(self.minimum).max(), np.abs(self.maximum).max()))
        return largest if largest > 0 else 1.0


def calibration_from_vectors(
    vectors: np.ndarray, *, dimensions: int | None = None, normalize: bool = True
) -> Calibration:
    """The ranges of `vectors` ([texts, dims]) as a request gets them: truncated to their first
    `dimensions` and, when `normalize`, renormalised (as embedding._postprocess does), then each
    dimension's minimum and maximum."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or not vectors.shape[0] or not vectors.shape[1]:
        raise QuantizationError(f"calibration vectors are [texts, dims], not of shape {vectors.shape}")
    if dimensions is not None:
        if not 1 <= dimensions <= vectors.shape[1]:
            raise QuantizationError(
                f"the calibration vectors have {vectors.shape[1]} dimensions; cannot calibrate {dimensions}"
            )
        vectors = vectors[:, :dimensions]
        if normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, np.float32(1e-12))
    return Calibration(minimum=vectors.min(axis=0), maximum=vectors.max(axis=0))


# (path, file version, dimensions, normalize) -> Calibration; the file version as file_sha256 keys it.
_calibrations: dict[tuple, Calibration] = {}
_CALIBRATIONS_KEPT = 64


def model_calibration(
    repository_dir: Path, triton_model: str, version: str | int, *, dimensions: int | None, normalize: bool
) -> Calibration | None:
    """The int8/uint8 calibration of `triton_model`'s export `version` ("" or None: the latest
    finished one) at `dimensions` (None: the model's width), from the calibration.npy its
    export.json records; None when the export has none (exported before calibration, a
    cross-encoder, or no export here).

    Loaded once per version of the file and width. Raises ModelExportMismatch when export.json
    records vectors that are missing or are not the ones it describes (a re-export of that model
    mends it), and QuantizationError for more `dimensions` than the model has.
    """
    if version in ("", None):
        version = model_export_latest(repository_dir, triton_model)
        if version is None:
            return None
    version_dir = model_export_version_dir(repository_dir=repository_dir, name=triton_model, version=version)
    try:
        info = json.loads((version_dir / EXPORT_INFO_FILENAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    record = info.get(QUANTIZATION_RECORD)
    if not isinstance(record, dict):
        return None
    filename = record.get("vectors")
    if not isinstance(filename, str) or not filename or Path(filename).name != filename:
        raise ModelExportMismatch(f"{version_dir / EXPORT_INFO_FILENAME} names no calibration file")
    path = version_dir / filename
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise ModelExportMismatch(
            f"{path} is missing; {version_dir / EXPORT_INFO_FILENAME} records it: re-export the model "
            "(manage.py export_model)"
        ) from None
    key = (str(path), (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))
    key += (dimensions, bool(normalize))
    calibration = _calibrations.get(key)
    if calibration is None:
        vectors = _calibration_vectors(path, record, info.get("dims"))
        calibration = calibration_from_vectors(vectors, dimensions=dimensions, normalize=normalize)
        if len(_calibrations) >= _CALIBRATIONS_KEPT:
            _calibrations.clear()
        _calibrations[key] = calibration
    return calibration


def _calibration_vectors(path: Path, record: dict, dims: int | None) -> np.ndarray:
    """The recorded calibration vectors, checked against their record: checksum and shape."""
    raw = path.read_bytes()
    recorded = record.get("vectors_sha256")
    if recorded and hashlib.sha256(raw).hexdigest() != recorded:
        raise ModelExportMismatch(
            f"{path} is not the calibration its export.json records (SHA-256 differs): re-export the model"
        )
    try:
        vectors = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as error:
        raise ModelExportMismatch(f"{path} is not a calibration array: {error}") from error
    texts = record.get("texts")
    if vectors.ndim != 2 or (dims and vectors.shape[1] != dims) or (texts and vectors.shape[0] != texts):
        raise ModelExportMismatch(
            f"{path} holds vectors of shape {vectors.shape}; its export.json records {texts} texts of "
            f"{dims} dimensions"
        )
    return vectors


def quantized(vectors: np.ndarray, output_type: str, calibration: Calibration | None) -> np.ndarray:
    """`vectors` (float32, [n, d]) as `output_type`:

    - float: float32 [n, d], as they are;
    - int8: int8 [n, d], round(v * 127 / scale) clipped to [-127, 127], `scale` the calibration's
      largest magnitude of any dimension;
    - uint8: uint8 [n, d], the int8 code + 128 (1 to 255);
    - binary: int8 [n, d / 8], packbits(v > 0) - 128;
    - ubinary: uint8 [n, d / 8], packbits(v > 0).

    int8 and uint8 need a `calibration` of width d; binary and ubinary a d that is a multiple of 8.
    """
    if output_type not in OUTPUT_TYPES:
        raise QuantizationError(f"unknown output type {output_type!r}; one of {', '.join(OUTPUT_TYPES)}")
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise QuantizationError(f"vectors are [n, dims], not of shape {vectors.shape}")
    dims = vectors.shape[1]
    if output_type == FLOAT:
        return np.ascontiguousarray(vectors)
    if output_type in PACKED_TYPES:
        _check_packable(output_type, dims)
        packed = np.packbits(vectors > 0, axis=-1)
        if output_type == UBINARY:
            return packed
        return (packed.astype(np.int16) - 128).astype(np.int8)
    if calibration is None:
        raise QuantizationError(
            f"{output_type} embeddings need the model's calibrated ranges, and this export has none: "
            "re-export the model (manage.py export_model)"
        )
    if calibration.dims != dims:
        raise QuantizationError(f"the calibration has {calibration.dims} dimensions, the vectors {dims}")
    codes = np.clip(
        np.rint(vectors.astype(np.float64) * (INT8_LIMIT / calibration.scale)), -INT8_LIMIT, INT8_LIMIT
    )
    if output_type == UINT8:
        return (codes + 128).astype(np.uint8)
    return codes.astype(np.int8)


def output_bytes(output_type: str, dims: int) -> int:
    """Bytes one `dims`-wide vector takes as `output_type` (384 dims: float 1,536, int8 and uint8
    384, binary and ubinary 48)."""
    if output_type not in OUTPUT_TYPES:
        raise QuantizationError(f"unknown output type {output_type!r}; one of {', '.join(OUTPUT_TYPES)}")
    if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
        raise QuantizationError(f"a vector has at least one dimension, not {dims!r}")
    if output_type in PACKED_TYPES:
        _check_packable(output_type, dims)
        return dims // 8
    return dims * np.dtype(OUTPUT_DTYPES[output_type]).itemsize


def _check_packable(output_type: str, dims: int) -> None:
    if dims % 8:
        raise QuantizationError(
            f"{output_type} embeddings pack eight dimensions to a byte: {dims} dimensions is not a "
            "multiple of 8 (ask for dimensions that are)"
        )
