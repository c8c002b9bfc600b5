"""An int8 embedding model from a verified float32 export: ONNX Runtime's dynamic quantisation, and
how far its vectors stray from the float32 graph's on the calibration corpus's held-out texts.

Dynamic, not static: on all-MiniLM-L6-v2 and the held-out texts, dynamic quantisation (int8
weights per output channel, activations' uint8 range taken per batch at run time) kept mean cosine
0.993 and recall@10 0.90 against float32, where static QDQ calibrated on 400 of the shipped
calibration texts (MinMax, weights per channel) kept 0.936 and 0.73 with only its MatMuls
quantised, 0.376 and 0.23 with every operator (README: the table). The feed-forward
down-projections stay float32 (see `float32_matmuls`): quantised, they alone took MiniLM's min
cosine from 0.991 to 0.979.

Export-only: onnxruntime.quantization is never imported by the service."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from embeddings.services.inference.exports import ModelExportError, file_sha256
from embeddings.tooling.calibration_corpus import HELD_OUT_CORPUS, read_corpus
from embeddings.tooling.model_configs import EMBEDDING_OUTPUT

DEFAULT_MIN_COSINE = 0.99
RECALL_K = 10
QUANTIZATION_METHOD = (
    "onnxruntime dynamic: int8 weights per output channel, uint8 activations ranged per batch; "
    "feed-forward down-projections float32"
)
# Texts embedded a call; sorted by length so a batch pads little.
BATCH = 32


def int8_quantize(*, model_path: Path, tokenizer, min_cosine: float = DEFAULT_MIN_COSINE) -> dict:
    """Replace the float32 graph at `model_path` with its int8 quantisation, once that agrees with
    it well enough: the lowest cosine between the two graphs' vectors of a held-out text at least
    `min_cosine`, else ModelExportError naming the figures and nothing changes. Returns
    export.json's record: the method, and min and mean cosine and recall@10 (each held-out text a
    query against the others, the int8 ten best against the float32 ten best) against float32."""
    if not 0.0 < min_cosine <= 1.0:
        raise ModelExportError(f"the int8 export's min cosine must be in (0, 1], not {min_cosine}")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model_path = Path(model_path)
    texts = read_corpus(HELD_OUT_CORPUS)
    float32_vectors = embed_corpus(model_path, tokenizer, texts)
    float32_sha256 = file_sha256(model_path)
    kept = float32_matmuls(model_path)
    handle, scratch = tempfile.mkstemp(prefix=".int8-", suffix=".onnx", dir=model_path.parent)
    os.close(handle)
    scratch = Path(scratch)
    # mkstemp's file is its owner's alone; the served model is read by Triton's user too.
    scratch.chmod(model_path.stat().st_mode & 0o777)
    try:
        with _quiet_root_logger():
            quantize_dynamic(
                str(model_path),
                str(scratch),
                weight_type=QuantType.QInt8,
                per_channel=True,
                nodes_to_exclude=kept,
            )
        int8_vectors = embed_corpus(scratch, tokenizer, texts)
        cosines = row_cosines(int8_vectors, float32_vectors)
        record = {
            "method": QUANTIZATION_METHOD,
            "float32_matmuls": len(kept),
            "reference": "this export's float32 graph",
            "reference_sha256": float32_sha256,
            "texts": HELD_OUT_CORPUS.name,
            "texts_sha256": file_sha256(HELD_OUT_CORPUS),
            "text_count": len(texts),
            "min_cosine": float(cosines.min()),
            "mean_cosine": float(cosines.mean()),
            f"recall_at_{RECALL_K}": recall_at_k(float32_vectors, int8_vectors, RECALL_K),
            "min_cosine_required": min_cosine,
        }
        if record["min_cosine"] < min_cosine:
            raise ModelExportError(
                f"the int8 graph disagrees with float32 on {HELD_OUT_CORPUS.name}: min cosine "
                f"{record['min_cosine']:.5f} < {min_cosine} required (mean {record['mean_cosine']:.5f}, "
                f"recall@{RECALL_K} {record[f'recall_at_{RECALL_K}']:.3f}); nothing was exported. Lower "
                "--min-cosine to accept it, or export float32"
            )
        os.replace(scratch, model_path)
    finally:
        scratch.unlink(missing_ok=True)
    return record


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """onnxruntime.quantization logs every node it passes over (INFO) and advice (WARNING) on the
    root logger: hundreds of lines in the middle of the command's output."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def float32_matmuls(model_path: Path) -> list[str]:
    """The MatMuls left in float32: each layer's feed-forward down-projection (a constant weight
    with more rows than columns, e.g. 1536 -> 384). Their input is the GELU's output, whose few
    large values stretch the one uint8 range a batch's activations share, so the many small ones
    lose their precision."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    shapes = {tensor.name: tuple(tensor.dims) for tensor in graph.initializer}
    return [
        node.name
        for node in graph.node
        if node.op_type == "MatMul"
        and len(shapes.get(node.input[1], ())) == 2
        and shapes[node.input[1]][0] > shapes[node.input[1]][1]
    ]


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
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
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
