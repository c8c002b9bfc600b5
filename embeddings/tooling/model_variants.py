"""An embedding model's variants of its verified float32 graph: int8 for CPUs (model_int8.py) and
float16 for GPUs (model_float16.py). Each is converted beside the float32 graph and replaces it only
when its vectors of the calibration corpus's held-out texts agree with float32's: the lowest cosine
of a text's two vectors at least a threshold. export.json keeps the figures under the dtype's name.

Export-only: nothing here is imported by the service."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from embeddings.services.inference.exports import (
    DTYPE_FLOAT16,
    DTYPE_FLOAT32,
    DTYPE_INT8,
    ModelExportError,
    file_sha256,
)
from embeddings.tooling.calibration_corpus import HELD_OUT_CORPUS, read_corpus
from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.model_configs import EMBEDDING_OUTPUT
from embeddings.tooling.model_float16 import float16_graph_write
from embeddings.tooling.model_int8 import int8_graph_write

# Each variant's default threshold, with margin under what MiniLM measured (README: the tables):
# int8 0.991, float16 0.999999 (a float16 graph's error is rounding, ~100x under this one).
DEFAULT_MIN_COSINES: dict[str, float] = {DTYPE_INT8: 0.99, DTYPE_FLOAT16: 0.9999}
VARIANT_DTYPES: tuple[str, ...] = tuple(DEFAULT_MIN_COSINES)
RECALL_K = 10
# Texts embedded a call; sorted by length so a batch pads little.
BATCH = 32

# dtype -> writes the variant of the float32 graph at its first path to its second; returns what
# export.json records of how (the method, and which parts stayed float32).
VariantWriter = Callable[[Path, Path], dict]
VARIANT_WRITERS: dict[str, VariantWriter] = {DTYPE_INT8: int8_graph_write, DTYPE_FLOAT16: float16_graph_write}


def variant_min_cosine(dtype: str, min_cosine: float | None = None) -> float:
    """The threshold a `dtype` export is held to: `min_cosine`, checked, else the dtype's default."""
    if dtype not in DEFAULT_MIN_COSINES:
        raise ModelExportError(f"{dtype!r} is not a variant of float32: one of {', '.join(VARIANT_DTYPES)}")
    if min_cosine is None:
        return DEFAULT_MIN_COSINES[dtype]
    if (
        isinstance(min_cosine, bool)
        or not isinstance(min_cosine, (int, float))
        or not 0.0 < min_cosine <= 1.0
    ):
        raise ModelExportError(f"the {dtype} export's min cosine must be in (0, 1], not {min_cosine!r}")
    return float(min_cosine)


def variant_replace(*, model_path: Path, tokenizer, dtype: str, min_cosine: float | None = None) -> dict:
    """Replace the float32 graph at `model_path` with its `dtype` variant, once that agrees with it
    well enough: the lowest cosine between the two graphs' vectors of a held-out text at least
    `min_cosine` (default: the dtype's), else ModelExportError naming the figures and nothing
    changes. Returns export.json's record: how it was made, and min and mean cosine and recall@10
    (each held-out text a query against the others, the variant's ten best against float32's)."""
    required = variant_min_cosine(dtype, min_cosine)
    model_path = Path(model_path)
    texts = read_corpus(HELD_OUT_CORPUS)
    float32_vectors = embed_corpus(model_path, tokenizer, texts)
    float32_sha256 = file_sha256(model_path)
    handle, scratch = tempfile.mkstemp(prefix=f".{dtype}-", suffix=".onnx", dir=model_path.parent)
    os.close(handle)
    scratch = Path(scratch)
    # mkstemp's file is its owner's alone; the served model is read by Triton's user too.
    scratch.chmod(model_path.stat().st_mode & 0o777)
    try:
        with _quiet_root_logger():
            made = VARIANT_WRITERS[dtype](model_path, scratch)
        vectors = embed_corpus(scratch, tokenizer, texts)
        cosines = row_cosines(vectors, float32_vectors)
        record = {
            **made,
            "reference": f"this export's {DTYPE_FLOAT32} graph",
            "reference_sha256": float32_sha256,
            "texts": HELD_OUT_CORPUS.name,
            "texts_sha256": file_sha256(HELD_OUT_CORPUS),
            "text_count": len(texts),
            "min_cosine": float(cosines.min()),
            "mean_cosine": float(cosines.mean()),
            f"recall_at_{RECALL_K}": recall_at_k(float32_vectors, vectors, RECALL_K),
            "min_cosine_required": required,
        }
        # NaN (a value the variant cannot hold, e.g. past float16's 65504) fails too.
        if not (math.isfinite(record["min_cosine"]) and record["min_cosine"] >= required):
            raise ModelExportError(
                f"the {dtype} graph disagrees with float32 on {HELD_OUT_CORPUS.name}: min cosine "
                f"{record['min_cosine']:.8f} < {required} required (mean {record['mean_cosine']:.8f}, "
                f"recall@{RECALL_K} {record[f'recall_at_{RECALL_K}']:.3f}); nothing was exported. Lower "
                "--min-cosine to accept it, or export float32"
            )
        os.replace(scratch, model_path)
    finally:
        scratch.unlink(missing_ok=True)
    return record


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """onnxruntime.quantization logs every node it passes over (INFO) and advice (WARNING), and
    onnxruntime.transformers each Cast it removes (INFO), through the root logger: lines in the
    middle of the command's output."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def recall_at_k(reference: np.ndarray, vectors: np.ndarray, k: int) -> float:
    """Mean share of each text's k nearest others by `reference` (dot product of unit vectors) that
    its k nearest by `vectors` hold, the text itself left out; ties broken by text order."""
    reference_scores = reference.astype(np.float64) @ reference.T.astype(np.float64)
    scores = vectors.astype(np.float64) @ vectors.T.astype(np.float64)
    np.fill_diagonal(reference_scores, -np.inf)
    np.fill_diagonal(scores, -np.inf)
    expected = np.argsort(-reference_scores, axis=1, kind="stable")[:, :k]
    found = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(expected, found, strict=True)]))


def embed_corpus(model_path: Path, tokenizer, texts: list[str], *, batch: int = BATCH) -> np.ndarray:
    """An embedding graph's vectors of `texts` (float32 [texts, dims], in their order), as served:
    the exported tokenizer's truncation and right padding, texts of like length batched together."""
    session = cpu_session(model_path)
    # Real lengths (all are padded to the longest here); each batch is padded on its own below.
    lengths = [sum(encoding.attention_mask) for encoding in tokenizer.encode_batch(texts)]
    order = sorted(range(len(texts)), key=lengths.__getitem__)
    vectors: np.ndarray | None = None
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        encodings = tokenizer.encode_batch([texts[row] for row in rows])
        feeds = {
            "input_ids": np.array([encoding.ids for encoding in encodings], dtype=np.int64),
            "attention_mask": np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64),
        }
        embedded = session.run([EMBEDDING_OUTPUT], feeds)[0]
        if vectors is None:
            vectors = np.empty((len(texts), embedded.shape[1]), dtype=np.float32)
        vectors[rows] = embedded
    assert vectors is not None
    return vectors


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each row of `a`'s cosine with the same row of `b`, in float64."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
