"""Ranking documents by relevance to a query: the service behind /v2/rerank, /v1/rerank and /rerank.

An embedding model the catalog lets rank (`EmbeddingModel.rerank_by_similarity`) embeds the query
and the documents in one call and scores each document by the cosine similarity of its vector
and the query's, in [-1, 1]. The query takes the model's "query" prompt and the documents its
"document" (or "passage") prompt where it has them (e5-style models are trained so), else both
its default prompt. One request is one quota reservation of all its tokens (the query's and every
document's), one inference deadline and one usage record, as an embeddings request is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from django.conf import settings

from embeddings.errors.service import InvalidRequest, LimitExceeded, UnsupportedByModel
from embeddings.models import TASK_RERANK, EmbeddingModel
from embeddings.services.inference.embedding import EmbeddingOptions, EmbeddingTarget, embeddings_create
from embeddings.tokenization import TokenizationError, TruncationDirection

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


@dataclass(frozen=True)
class RankingResult:
    """Each document's score, in input order, and what producing them cost."""

    model: str
    scores: np.ndarray
    query_tokens: int
    document_tokens: np.ndarray
    tokenization_s: float
    inference_s: float

    @property
    def total_tokens(self) -> int:
        return self.query_tokens + int(self.document_tokens.sum())

    @property
    def inputs(self) -> int:
        """The texts embedded: the query and every document."""
        return 1 + len(self.document_tokens)

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


def _prompt(target: EmbeddingTarget, names: Sequence[str]) -> str:
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
) -> RankingResult:
    """Score `documents` against `query` with `model` (see the module docstring)."""
    ranking_check(
        model=model, documents=len(documents), max_tokens_per_document=options.max_tokens_per_document
    )
    if model.task == TASK_RERANK:
        raise UnsupportedByModel(
            f"The model {model.name!r} is a cross-encoder, which this server cannot run yet; rank with an "
            "embedding model that ranks by similarity.",
            param="model",
        )
    target = EmbeddingTarget.for_model(model)
    query_prompt, document_prompt = _prompt(target, ("query",)), _prompt(target, DOCUMENT_PROMPTS)
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
        query_tokens=int(result.token_counts[0]),
        document_tokens=result.token_counts[1:],
        tokenization_s=result.tokenization_s,
        inference_s=result.inference_s,
    )
