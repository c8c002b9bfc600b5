"""Ranking documents by relevance to a query: the service behind /v2/rerank, /v1/rerank and /rerank.

A rerank model (a cross-encoder) reads each (query, document) pair as it was trained to, the
tokenizer's pair template with its token types, the document truncated to fit, and returns its
logit; its activation (export.json's, in the catalog: sigmoid for most) turns that into the score,
unless raw scores are asked for. Pairs go through the same fair scheduler, coalescer and deadline
as embeddings, in token-bounded sub-batches; every pair's tokens are counted (the query's once a
pair).

An embedding model the catalog lets rank (`EmbeddingModel.rerank_by_similarity`) embeds the query
and the documents in one call and scores each document by the cosine similarity of its vector
and the query's, in [-1, 1]. The query takes the prompt the catalog maps the "query" input type
to and the documents the "document" one's, else the prompts named "query" and "document" (or
"passage") where the model has them (e5-style models are trained so), else both its default prompt.
One request is one quota reservation of all its tokens (the query's and every document's), one
inference deadline and one usage record, as an embeddings request is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from django.conf import settings

from embeddings.errors.service import InvalidRequest, LimitExceeded, UnsupportedByModel
from embeddings.metrics import TOKENIZATION_SECONDS
from embeddings.model_tasks import ACTIVATION_SIGMOID
from embeddings.models import TASK_RERANK, EmbeddingModel
from embeddings.observability import tracing
from embeddings.services.inference.clients import model_tokenizer
from embeddings.services.inference.embedding import (
    TOKENIZE_IN_THREAD_ABOVE,
    EmbeddingOptions,
    EmbeddingTarget,
    embeddings_create,
    tokens_infer,
)
from embeddings.tokenization import TokenizationError, TokenizedBatch, TruncationDirection
from embeddings.triton import TritonModelError

if TYPE_CHECKING:
    from embeddings.services.quotas.limits import RequestQuota

SIMILARITY_SCORE_RANGE = (-1.0, 1.0)
DOCUMENT_PROMPTS = ("document", "passage")


@dataclass(frozen=True)
class RankingOptions:
    truncate: bool = True
    direction: TruncationDirection = "right"
    # Documents keep at most this many tokens (default RERANK_MAX_TOKENS_PER_DOCUMENT; the model's
    # maximum is the ceiling either way).
    max_tokens_per_document: int | None = None
    # A cross-encoder's logits as they are, its activation not applied (TEI's raw_scores).
    raw_scores: bool = False


@dataclass(frozen=True)
class RankingResult:
    """Each document's score, in input order, and what producing them cost."""

    model: str
    scores: np.ndarray
    # Tokens of each input the model read: a cross-encoder's pairs, or the query and then each
    # document for a similarity ranking.
    token_counts: np.ndarray
    tokenization_s: float
    inference_s: float

    @property
    def total_tokens(self) -> int:
        return int(self.token_counts.sum())

    @property
    def inputs(self) -> int:
        return len(self.token_counts)

    def ranked(self, top_n: int | None = None) -> list[int]:
        """Document indices, highest score first (ties in input order), the first `top_n`."""
        order = np.argsort(-self.scores, kind="stable")
        return [int(index) for index in order[:top_n]]


def ranking_check(*, model: EmbeddingModel, documents: int, max_tokens_per_document: int | None) -> None:
    """Refuse what no model may rank: too many documents, a document limit outside the server's."""
    if documents > settings.RERANK_MAX_DOCUMENTS:
        raise LimitExceeded(
            f"{documents} documents in one request; at most {settings.RERANK_MAX_DOCUMENTS} may be ranked at "
            "once (RERANK_MAX_DOCUMENTS)",
            param="documents",
        )
    ceiling = settings.RERANK_MAX_TOKENS_PER_DOCUMENT
    if max_tokens_per_document is not None and max_tokens_per_document < 2:
        raise InvalidRequest(
            "max_tokens_per_doc must be at least 2 (a document's special tokens)", param="max_tokens_per_doc"
        )
    if max_tokens_per_document is not None and max_tokens_per_document > ceiling:
        raise LimitExceeded(
            f"max_tokens_per_doc is at most {ceiling} here (RERANK_MAX_TOKENS_PER_DOCUMENT)",
            param="max_tokens_per_doc",
        )
    if not model.ranks:
        raise UnsupportedByModel(
            f"The model {model.name!r} is an embedding model that does not rank documents; name a rerank "
            "model (GET /v1/models says which models rank).",
            param="model",
        )


def _in_rerank_terms(error: TokenizationError) -> TokenizationError:
    """ "Input 0" is the query and "Input k" document k - 1 here."""
    if error.index is None:
        return error
    if error.index == 0:
        return error.restated(re.sub(r"^Input 0\b", "The query", str(error)), param="query")
    message = re.sub(r"^Input \d+", f"Document {error.index - 1}", str(error))
    return error.restated(message, param="documents")


def _prompt(target: EmbeddingTarget, input_type: str, names: Sequence[str]) -> str:
    """The prompt the catalog maps `input_type` to, else the first of `names` the model has, else
    its default prompt."""
    if input_type in dict(target.input_types):
        return target.prompt(None, input_type)
    prompts = dict(target.prompts)
    for name in names:
        if name in prompts:
            return prompts[name]
    return prompts.get(target.default_prompt_name, "")


async def rerank_create(
    *,
    model: EmbeddingModel,
    query: str,
    documents: Sequence[str],
    options: RankingOptions = RankingOptions(),
    quota: RequestQuota | None = None,
    cache_scope: str | None = None,
) -> RankingResult:
    """Score `documents` against `query` with `model` (see the module docstring). By similarity,
    the query's and documents' vectors come from the embedding cache where it holds them
    (`cache_scope`, as for embeddings_create); a cross-encoder's pair scores are not cached."""
    ranking_check(
        model=model, documents=len(documents), max_tokens_per_document=options.max_tokens_per_document
    )
    if model.task == TASK_RERANK:
        return await _rerank_pairs(
            model=model, query=query, documents=documents, options=options, quota=quota
        )
    target = EmbeddingTarget.for_model(model)
    query_prompt = _prompt(target, "query", ("query",))
    document_prompt = _prompt(target, "document", DOCUMENT_PROMPTS)
    default_limit = settings.RERANK_MAX_TOKENS_PER_DOCUMENT
    document_limit = min(model.max_tokens, options.max_tokens_per_document or default_limit)
    # The prompts are added here, per side, so the target adds none; the documents count against
    # RERANK_MAX_DOCUMENTS, not the embedding endpoints' input limit.
    try:
        result = await embeddings_create(
            target=dataclasses.replace(target, prompts=(), default_prompt_name="", max_inputs=None),
            texts=[query_prompt + query, *(document_prompt + document for document in documents)],
            options=EmbeddingOptions(
                truncate=options.truncate,
                direction=options.direction,
                max_tokens=(model.max_tokens, *[document_limit] * len(documents)),
            ),
            quota=quota,
            cache_scope=cache_scope,
        )
    except TokenizationError as error:
        raise _in_rerank_terms(error) from None
    except LimitExceeded as error:
        if error.param != "input":
            raise
        # The embedding path's "The inputs have N tokens in all": here the query's and documents'.
        message = error.message.replace("The inputs have", "The query and the documents have", 1)
        raise LimitExceeded(message, param="documents") from None
    vectors = result.vectors.astype(np.float64)
    norms = np.maximum(np.linalg.norm(vectors, axis=1), 1e-12)
    scores = (vectors[1:] @ vectors[0]) / (norms[1:] * norms[0])
    return RankingResult(
        model=model.name,
        scores=np.clip(scores, *SIMILARITY_SCORE_RANGE).astype(np.float32),
        token_counts=result.token_counts,
        tokenization_s=result.tokenization_s,
        inference_s=result.inference_s,
    )


def scores_activated(logits: np.ndarray, activation: str) -> np.ndarray:
    """A cross-encoder's relevance scores from its logits (float64 in, float32 out)."""
    if activation == ACTIVATION_SIGMOID:
        # exp of a large positive logit overflows: 1 / (1 + exp(-x)) for x >= 0, exp(x) / (1 + exp(x)) else.
        positive = logits >= 0
        exp = np.exp(-np.abs(logits))
        logits = np.where(positive, 1.0 / (1.0 + exp), exp / (1.0 + exp))
    return logits.astype(np.float32)


def _pairs_tokenize(
    target: EmbeddingTarget,
    query: str,
    documents: Sequence[str],
    options: RankingOptions,
    document_limit: int,
) -> tuple[TokenizedBatch, float]:
    started = time.perf_counter()
    with tracing.span("tokenize", model=target.triton_model):
        tokenizer = model_tokenizer(target.triton_model, target.max_tokens, target.triton_version)
        batch = tokenizer.encode_pairs(
            query,
            list(documents),
            truncate=options.truncate,
            direction=options.direction,
            max_document_tokens=document_limit,
            buckets=tuple(settings.SEQUENCE_LENGTH_BUCKETS),
        )
    if target.max_total_tokens is not None and batch.total_tokens > target.max_total_tokens:
        raise LimitExceeded(
            f"The query and documents make {batch.total_tokens} tokens as pairs (the query in each); a "
            f"request may have at most {target.max_total_tokens}: send fewer or shorter documents",
            param="documents",
        )
    elapsed = time.perf_counter() - started
    TOKENIZATION_SECONDS.labels(target.triton_model).observe(elapsed)
    return batch, elapsed


async def _rerank_pairs(
    *,
    model: EmbeddingModel,
    query: str,
    documents: Sequence[str],
    options: RankingOptions,
    quota: RequestQuota | None,
) -> RankingResult:
    """A cross-encoder's scores of (query, document) pairs (see the module docstring)."""
    timeout_s = settings.EMBEDDING_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    target = EmbeddingTarget.for_ranking(model)
    document_limit = options.max_tokens_per_document or settings.RERANK_MAX_TOKENS_PER_DOCUMENT
    size = len(query) + sum(len(document) for document in documents)
    try:
        if size > TOKENIZE_IN_THREAD_ABOVE:
            batch, tokenization_s = await asyncio.to_thread(
                _pairs_tokenize, target, query, documents, options, document_limit
            )
        else:
            batch, tokenization_s = _pairs_tokenize(target, query, documents, options, document_limit)
    except TokenizationError as error:
        raise _in_rerank_terms(error) from None

    def finish(outputs: np.ndarray) -> np.ndarray:
        if outputs.shape != (len(batch), 1):
            raise TritonModelError(
                f"model {target.triton_model!r} returned {list(outputs.shape)} for {len(batch)} pairs, "
                "not one score each"
            )
        return outputs[:, 0].astype(np.float64)

    logits, inference_s, _ = await tokens_infer(
        target, batch, deadline=deadline, timeout_s=timeout_s, quota=quota, finish=finish
    )
    scores = (
        logits.astype(np.float32) if options.raw_scores else scores_activated(logits, model.score_activation)
    )
    return RankingResult(
        model=model.name,
        scores=scores,
        token_counts=batch.token_counts,
        tokenization_s=tokenization_s,
        inference_s=inference_s,
    )
