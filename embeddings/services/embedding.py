"""Embedding inputs: tokenise in the service, call Triton, post-process, count tokens.

One implementation behind every endpoint, the Celery tasks and the `embed` command.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from django.conf import settings

from embeddings.metrics import TOKENIZATION_SECONDS, TRITON_IN_FLIGHT, triton_call_observed
from embeddings.services.errors import InvalidRequest, LimitExceeded, Overloaded
from embeddings.services.inference import model_tokenizer, triton_async_client, triton_sync_client
from embeddings.tokenization import TextTokenizer, TokenizedBatch, TruncationDirection
from embeddings.triton import ModelSpec, TritonModelError

if TYPE_CHECKING:
    from embeddings.models import EmbeddingModel
    from embeddings.services.quotas import RequestQuota


@dataclass(frozen=True)
class EmbeddingTarget:
    """The Triton model that serves a request and its limits (from an EmbeddingModel or settings)."""

    triton_model: str
    triton_version: str = ""
    # None: the tokenizer's own maximum (what the model was exported with).
    max_tokens: int | None = None
    # None: whatever the model returns.
    dimensions: int | None = None
    # None: no limit (the API always sets both).
    max_inputs: int | None = None
    max_total_tokens: int | None = None
    # Prompt name -> text prepended to every input; the default applies when none is asked for.
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str = ""

    @classmethod
    def default(cls) -> EmbeddingTarget:
        return cls(settings.MODEL_NAME, settings.MODEL_VERSION, dimensions=settings.EMBEDDING_SIZE)

    @classmethod
    def for_model(cls, model: EmbeddingModel) -> EmbeddingTarget:
        return cls(
            triton_model=model.triton_model,
            triton_version=model.triton_version,
            max_tokens=model.max_tokens,
            dimensions=model.dimensions,
            max_inputs=model.max_inputs_per_request or settings.MAX_INPUTS_PER_REQUEST,
            max_total_tokens=model.max_tokens_per_request or settings.MAX_TOKENS_PER_REQUEST,
            prompts=tuple(sorted((model.prompts or {}).items())),
            default_prompt_name=model.default_prompt_name,
        )

    def prompt(self, name: str | None) -> str:
        """The text to prepend for `name` (or the default prompt); unknown names are refused."""
        name = name or self.default_prompt_name
        if not name:
            return ""
        for prompt_name, text in self.prompts:
            if prompt_name == name:
                return text
        known = ", ".join(prompt_name for prompt_name, _ in self.prompts) or "none"
        raise InvalidRequest(
            f"Unknown prompt_name {name!r}; this model's prompts: {known}", param="prompt_name"
        )


@dataclass(frozen=True)
class EmbeddingOptions:
    truncate: bool = True
    direction: TruncationDirection = "right"
    # Keep the first N dimensions (Matryoshka-style), re-normalised when `normalize`.
    dimensions: int | None = None
    normalize: bool = True
    prompt_name: str | None = None


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


class InflightGate:
    """Bounds the inference calls one process has in flight: beyond the limit, refuse at once.

    A bounded queue would only move the wait into our process; refusing with 429 + Retry-After
    lets clients and load balancers back off, and nothing waits forever.
    """

    def __init__(self) -> None:
        self.in_flight = 0

    def __enter__(self) -> InflightGate:
        if self.in_flight >= settings.MAX_INFLIGHT_TRITON_CALLS:
            raise Overloaded(
                f"This server has {self.in_flight} embedding requests in flight, its maximum; retry shortly.",
                retry_after_s=1,
            )
        self.in_flight += 1
        TRITON_IN_FLIGHT.inc()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.in_flight -= 1
        TRITON_IN_FLIGHT.dec()


# The event loop runs one coroutine at a time, so the async path needs no lock around the count.
inflight_gate = InflightGate()


def _tokenize(
    target: EmbeddingTarget,
    texts: Sequence[str] | None,
    token_ids: Sequence[Sequence[int]] | None,
    options: EmbeddingOptions,
) -> tuple[TokenizedBatch, TextTokenizer, float]:
    started = time.perf_counter()
    count = len(token_ids if token_ids is not None else texts or ())
    if target.max_inputs is not None and count > target.max_inputs:
        raise LimitExceeded(
            f"{count} inputs in one request; this model takes at most {target.max_inputs}", param="input"
        )
    tokenizer = model_tokenizer(target.triton_model, target.max_tokens)
    if token_ids is not None:
        batch = tokenizer.encode_ids(list(token_ids), truncate=options.truncate, direction=options.direction)
    else:
        batch = tokenizer.encode(
            list(texts or ()),
            truncate=options.truncate,
            direction=options.direction,
            buckets=tuple(settings.SEQUENCE_LENGTH_BUCKETS),
        )
    if len(batch) == 0:
        raise InvalidRequest("input must contain at least one item", param="input")
    if target.max_total_tokens is not None and batch.total_tokens > target.max_total_tokens:
        raise LimitExceeded(
            f"The inputs have {batch.total_tokens} tokens in all; a request may have at most "
            f"{target.max_total_tokens}",
            param="input",
        )
    elapsed = time.perf_counter() - started
    TOKENIZATION_SECONDS.labels(target.triton_model).observe(elapsed)
    return batch, tokenizer, elapsed


def _takes_text(spec: ModelSpec, token_ids: object) -> bool:
    """Whether the model takes text (one BYTES input) rather than token ids; checks seed settings."""
    if settings.INPUT_NAME and spec.input(settings.INPUT_NAME) is None:
        raise TritonModelError(f"model {spec.name!r} has no input named {settings.INPUT_NAME!r} (INPUT_NAME)")
    takes_text = any(tensor.datatype == "BYTES" for tensor in spec.inputs)
    if takes_text and token_ids is not None:
        raise InvalidRequest(
            f"model {spec.name!r} tokenises inside Triton and takes text, not token ids", param="input"
        )
    return takes_text


def _with_prompt(
    target: EmbeddingTarget, texts: Sequence[str] | None, options: EmbeddingOptions
) -> Sequence[str] | None:
    prefix = target.prompt(options.prompt_name)
    if not prefix or texts is None:
        return texts
    return [prefix + text for text in texts]


def _check_options(target: EmbeddingTarget, options: EmbeddingOptions) -> None:
    if options.dimensions is not None:
        if options.dimensions < 1:
            raise InvalidRequest("dimensions must be at least 1", param="dimensions")
        if target.dimensions and options.dimensions > target.dimensions:
            raise InvalidRequest(
                f"dimensions {options.dimensions} is larger than the model's {target.dimensions}",
                param="dimensions",
            )


def _postprocess(target: EmbeddingTarget, vectors: np.ndarray, options: EmbeddingOptions) -> np.ndarray:
    if target.dimensions and vectors.shape[1] != target.dimensions:
        raise TritonModelError(
            f"model {target.triton_model!r} returned {vectors.shape[1]}-d vectors, "
            f"{target.dimensions} expected"
        )
    if options.dimensions is not None:
        if options.dimensions > vectors.shape[1]:
            raise InvalidRequest(
                f"dimensions {options.dimensions} is larger than the model's {vectors.shape[1]}",
                param="dimensions",
            )
        vectors = vectors[:, : options.dimensions]
        if options.normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, np.float32(1e-12))
    return np.ascontiguousarray(vectors, dtype=np.float32)


async def embeddings_create(
    *,
    target: EmbeddingTarget,
    texts: Sequence[str] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    options: EmbeddingOptions = EmbeddingOptions(),
    quota: RequestQuota | None = None,
) -> EmbeddingResult:
    """Embed `texts` (or pre-tokenised `token_ids`) with the target model, in input order.

    With `quota`, the request's tokens are reserved against its tenant's and key's limits after
    tokenisation and before inference (QuotaExceeded refuses it with nothing spent), and settled
    afterwards: kept when it succeeded, refunded when inference failed.
    """
    _check_options(target, options)
    texts = _with_prompt(target, texts, options)
    batch, _, tokenization_s = _tokenize(target, texts, token_ids, options)
    client = triton_async_client()
    with inflight_gate:
        if quota is not None:
            await quota.reserve(inputs=len(batch), tokens=batch.total_tokens)
        try:
            with triton_call_observed(target.triton_model):
                started = time.perf_counter()
                version = target.triton_version
                if _takes_text(await client.model_metadata(target.triton_model, version), token_ids):
                    vectors = await client.embed_texts(
                        target.triton_model,
                        list(texts or ()),
                        version=version,
                        output_name=settings.OUTPUT_NAME,
                    )
                else:
                    vectors = await client.embed_tokens(
                        target.triton_model,
                        batch.input_ids,
                        batch.attention_mask,
                        version=version,
                        output_name=settings.OUTPUT_NAME,
                    )
                inference_s = time.perf_counter() - started
            vectors = _postprocess(target, vectors, options)
        except BaseException:  # a Triton error, a bad output, or the client went away (cancelled)
            if quota is not None:
                await quota.settle(succeeded=False)
            raise
    if quota is not None:
        await quota.settle(succeeded=True)
    return EmbeddingResult(target.triton_model, vectors, batch.token_counts, tokenization_s, inference_s)


def embeddings_create_sync(
    *,
    target: EmbeddingTarget,
    texts: Sequence[str] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    options: EmbeddingOptions = EmbeddingOptions(),
) -> EmbeddingResult:
    """The blocking twin of `embeddings_create`, for Celery workers and commands (no in-flight gate)."""
    _check_options(target, options)
    texts = _with_prompt(target, texts, options)
    batch, _, tokenization_s = _tokenize(target, texts, token_ids, options)
    client = triton_sync_client()
    with triton_call_observed(target.triton_model):
        started = time.perf_counter()
        version = target.triton_version
        if _takes_text(client.model_metadata(target.triton_model, version), token_ids):
            vectors = client.embed_texts(
                target.triton_model, list(texts or ()), version=version, output_name=settings.OUTPUT_NAME
            )
        else:
            vectors = client.embed_tokens(
                target.triton_model,
                batch.input_ids,
                batch.attention_mask,
                version=version,
                output_name=settings.OUTPUT_NAME,
            )
        inference_s = time.perf_counter() - started
    vectors = _postprocess(target, vectors, options)
    return EmbeddingResult(target.triton_model, vectors, batch.token_counts, tokenization_s, inference_s)
