"""What an answer that ran a model says of it: its Server-Timing header, its log line and its
input and token counters (the embedding views, the express lane and the rerank views alike)."""

from __future__ import annotations

import logging
from typing import Protocol

from rest_framework.response import Response

from embeddings.callers import Caller
from embeddings.metrics import embedded_observed
from embeddings.models import EmbeddingModel

logger = logging.getLogger("embeddings.requests")


class Served(Protocol):
    """What an answer's log line, metrics and Server-Timing tell of: an EmbeddingResult, or a
    RankingResult (services/inference/ranking.py)."""

    tokenization_s: float
    inference_s: float

    @property
    def inputs(self) -> int: ...

    @property
    def total_tokens(self) -> int: ...


def log_request(
    caller: Caller, endpoint: str, model: EmbeddingModel, result: Served, user: str = "", *, action="embed"
):
    """The request's log line (`action`: embed, rerank) and its input and token counters."""
    embedded_observed(endpoint=endpoint, model=model.name, inputs=result.inputs, tokens=result.total_tokens)
    logger.info(
        "%s endpoint=%s tenant=%s key=%s model=%s inputs=%d tokens=%d inference_ms=%.1f user=%s",
        action,
        endpoint,
        caller.tenant_slug,
        caller.key_public_id,
        model.name,
        result.inputs,
        result.total_tokens,
        result.inference_s * 1000,
        user,
        # As fields of their own in JSON lines (README "Observability").
        extra={
            "tokenization_ms": round(result.tokenization_s * 1000, 3),
            "inference_ms": round(result.inference_s * 1000, 3),
        },
    )


def embedding_response(data: object, result: Served) -> Response:
    """The response, with where the time went in a Server-Timing header."""
    return Response(data, headers={"Server-Timing": timing_header(result)})


def timing_header(result: Served) -> str:
    """Server-Timing's value: tokenisation and inference, in milliseconds."""
    return f"tokenize;dur={result.tokenization_s * 1000:.3f}, inference;dur={result.inference_s * 1000:.3f}"
