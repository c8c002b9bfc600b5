"""Reference vectors for the service's: in-process ONNX Runtime on the served model.onnx, one input at a
time with no padding at all, and token ids taken from the served tokenizer.json without the service."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import onnxruntime as ort
from django.conf import settings
from tokenizers import Tokenizer

from embeddings.tooling.export_threads import cpu_session

CLS, SEP = 101, 102
# Texts the GPU backends are checked on: short, ASCII, non-ASCII, and over a hundred tokens.
MIXED_TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, 日本語のテキスト, and emoji 🚀 all tokenise.",
    "a much longer text about embeddings, tenants and quotas " * 12,
]


def served_version_dir() -> Path:
    return Path(settings.TRITON_MODEL_REPOSITORY) / "minilm" / "1"


@cache
def _session(model_path: str) -> ort.InferenceSession:
    return cpu_session(model_path)


def reference_session() -> ort.InferenceSession:
    return _session(str(served_version_dir() / "model.onnx"))


@cache
def _untruncated_tokenizer(path: str) -> Tokenizer:
    tokenizer = Tokenizer.from_file(path)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def token_ids(text: str) -> list[int]:
    """All of the text's token ids, [CLS] and [SEP] included, however long it is."""
    return _untruncated_tokenizer(str(served_version_dir() / "tokenizer.json")).encode(text).ids


def text_truncated(ids: list[int], max_tokens: int, direction: str) -> list[int]:
    """What truncating a text does to its ids: [CLS] and [SEP] kept, the text between them cut."""
    body = ids[1:-1]
    kept = body[: max_tokens - 2] if direction == "right" else body[len(body) - (max_tokens - 2) :]
    return [ids[0], *kept, ids[-1]]


def vectors_for_ids(rows: list[list[int]]) -> np.ndarray:
    """Each row run alone (no padding, a mask of ones), so no mask bug can reach the reference."""
    session = reference_session()
    vectors = []
    for ids in rows:
        input_ids = np.array([ids], dtype=np.int64)
        (embedding,) = session.run(
            ["embedding"], {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}
        )
        vectors.append(embedding[0])
    return np.stack(vectors)


def padded_ids(rows: list[list[int]], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`rows` right-padded with 0 to `length` (the longest row's by default), and their mask."""
    length = length or max(len(ids) for ids in rows)
    input_ids = np.zeros((len(rows), length), dtype=np.int64)
    attention_mask = np.zeros_like(input_ids)
    for index, ids in enumerate(rows):
        input_ids[index, : len(ids)] = ids
        attention_mask[index, : len(ids)] = 1
    return input_ids, attention_mask


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def chunks_of(ids: list[int], *, max_tokens: int, overlap: int) -> list[list[int]]:
    """What embedding a text in chunks does to its ids, written out: its own tokens (between [CLS]
    and [SEP]) in windows of max_tokens - 2, each `overlap` into the previous one, the last ending
    at the text's end, each wrapped in [CLS] ... [SEP]."""
    body, window = ids[1:-1], max_tokens - 2
    chunks, start = [], 0
    while True:
        chunks.append([ids[0], *body[start : start + window], ids[-1]])
        if start + window >= len(body):
            return chunks
        start += window - overlap


def chunks_aggregated(vectors: np.ndarray, chunks: list[list[int]]) -> np.ndarray:
    """The chunks' vectors averaged, each weighted by its tokens, then L2-normalised."""
    weights = np.array([len(chunk) for chunk in chunks], dtype=np.float64)
    mean = (np.asarray(vectors, dtype=np.float64) * weights[:, None]).sum(axis=0) / weights.sum()
    return mean / np.linalg.norm(mean)
