"""Embedding texts: tokenise in the service, call Triton, return unit vectors and token counts."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from django.conf import settings

from embeddings.services.inference import model_tokenizer, triton_async_client, triton_sync_client
from embeddings.tokenization import TokenizedBatch, TruncationDirection
from embeddings.triton import ModelSpec, TritonModelError


@dataclass(frozen=True)
class EmbeddingResult:
    """Vectors in input order (float32 [n, dims]) and what producing them cost."""

    model: str
    vectors: np.ndarray
    token_counts: np.ndarray
    tokenization_s: float
    inference_s: float

    @property
    def total_tokens(self) -> int:
        return int(self.token_counts.sum())


def _tokenize(
    texts: list[str], model: str, truncate: bool, direction: TruncationDirection
) -> tuple[TokenizedBatch, float]:
    started = time.perf_counter()
    batch = model_tokenizer(model).encode(
        texts, truncate=truncate, direction=direction, buckets=tuple(settings.SEQUENCE_LENGTH_BUCKETS)
    )
    return batch, time.perf_counter() - started


def _check_model(spec: ModelSpec) -> bool:
    """Whether the model takes text (a BYTES input) rather than token ids; checks seed settings."""
    if settings.INPUT_NAME and spec.input(settings.INPUT_NAME) is None:
        raise TritonModelError(f"model {spec.name!r} has no input named {settings.INPUT_NAME!r} (INPUT_NAME)")
    return any(tensor.datatype == "BYTES" for tensor in spec.inputs)


def _check_vectors(model: str, vectors: np.ndarray) -> np.ndarray:
    if settings.EMBEDDING_SIZE and vectors.shape[1] != settings.EMBEDDING_SIZE:
        raise TritonModelError(
            f"model {model!r} returned {vectors.shape[1]}-d vectors, "
            f"EMBEDDING_SIZE is {settings.EMBEDDING_SIZE}"
        )
    return vectors


async def embeddings_create(
    *,
    texts: list[str],
    model: str | None = None,
    truncate: bool = True,
    direction: TruncationDirection = "right",
) -> EmbeddingResult:
    model = model or settings.MODEL_NAME
    batch, tokenization_s = _tokenize(texts, model, truncate, direction)
    client = triton_async_client()
    started = time.perf_counter()
    options = {"version": settings.MODEL_VERSION, "output_name": settings.OUTPUT_NAME}
    if _check_model(await client.model_metadata(model, settings.MODEL_VERSION)):
        vectors = await client.embed_texts(model, texts, **options)
    else:
        vectors = await client.embed_tokens(model, batch.input_ids, batch.attention_mask, **options)
    inference_s = time.perf_counter() - started
    return EmbeddingResult(
        model, _check_vectors(model, vectors), batch.token_counts, tokenization_s, inference_s
    )


def embeddings_create_sync(
    *,
    texts: list[str],
    model: str | None = None,
    truncate: bool = True,
    direction: TruncationDirection = "right",
) -> EmbeddingResult:
    model = model or settings.MODEL_NAME
    batch, tokenization_s = _tokenize(texts, model, truncate, direction)
    client = triton_sync_client()
    started = time.perf_counter()
    options = {"version": settings.MODEL_VERSION, "output_name": settings.OUTPUT_NAME}
    if _check_model(client.model_metadata(model, settings.MODEL_VERSION)):
        vectors = client.embed_texts(model, texts, **options)
    else:
        vectors = client.embed_tokens(model, batch.input_ids, batch.attention_mask, **options)
    inference_s = time.perf_counter() - started
    return EmbeddingResult(
        model, _check_vectors(model, vectors), batch.token_counts, tokenization_s, inference_s
    )
