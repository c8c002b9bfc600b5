"""Embedding inputs: tokenise in the service, call Triton, post-process, count tokens.

One implementation behind every endpoint, the Celery tasks and the `embed` command. Requests are
sent to Triton as token-bounded sub-batches (embeddings.services.inference.scheduling): interleaved fairly
with other requests on the async path, a few at a time at Triton's bulk priority on the blocking
path, and each request's inference ends at its deadline.

Long inputs are truncated (right or left), refused, or, with `EmbeddingOptions.chunk`, embedded in
chunks: each over-long text's own tokens split into windows of the model's maximum (its special
tokens re-added around each, CHUNK_OVERLAP_TOKENS shared by neighbours; at most
MAX_CHUNKS_PER_INPUT an input), every chunk a row sent to Triton in the same sub-batches as the
request's other rows, and the input's vector the token-weighted mean of its chunks' vectors (each
weighted by its tokens, special tokens and overlap included), normalised, before the usual
post-processing (dimensions, output types). The model's graph normalises each row, so the chunks
are averaged as unit vectors, as vLLM averages them: a chunk's direction counts by its tokens
alone, not by its norm. Chunks cost what they are: every chunk's tokens count against the
request's token limit, its quota and its usage, and its rows against the model's inputs per
request. Pre-tokenised inputs are not chunked (their special tokens, if any, are the client's):
refused. A text's prompt is part of its text, so only its first chunk carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from django.conf import settings

from embeddings.errors.service import (
    InferenceTimeout,
    InvalidRequest,
    LimitExceeded,
    ModelNotLoaded,
    Overloaded,
    UnsupportedByModel,
)
from embeddings.metrics import (
    BATCH_ROWS,
    BATCH_TOKENS,
    QUEUE_SECONDS,
    TOKENIZATION_SECONDS,
    TOKENS_IN_FLIGHT,
    TRITON_IN_FLIGHT,
    triton_call_observed,
)
from embeddings.model_tasks import INPUT_TYPE_ALIASES, INPUT_TYPES
from embeddings.models import TASK_EMBED, TASK_RERANK
from embeddings.observability import context as request_context
from embeddings.observability import tracing
from embeddings.services.inference.clients import (
    inference_scheduler,
    model_tokenizer,
    request_coalescer,
    triton_async_client,
    triton_sync_client,
)
from embeddings.services.inference.exports import ModelExportError
from embeddings.services.inference.quantization import (
    Calibration,
    QuantizationError,
    model_calibration,
    quantized,
)
from embeddings.services.inference.scheduling import SubBatch, reassembled, sub_batches
from embeddings.services.inference.vector_cache import (
    served_model,
    vectors_get,
    vectors_get_sync,
    vectors_put,
    vectors_put_sync,
)
from embeddings.tokenization import ChunkedBatch, TokenizedBatch, TruncationDirection
from embeddings.triton import (
    PRIORITY_BULK,
    PRIORITY_INTERACTIVE,
    PRIORITY_LARGE,
    ModelSpec,
    TritonModelError,
    TritonModelNotLoaded,
)

if TYPE_CHECKING:
    from embeddings.models import EmbeddingModel
    from embeddings.services.quotas.limits import RequestQuota


@dataclass(frozen=True)
class EmbeddingTarget:
    """The Triton model that serves a request and its limits (from an EmbeddingModel or settings)."""

    triton_model: str
    triton_version: str = ""
    # The catalog model's name (what the client asked for), for errors; "" for the settings' model.
    name: str = ""
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
    # Input type -> prompt name (EmbeddingModel.input_types); empty: input types embed alike.
    input_types: tuple[tuple[str, str], ...] = ()

    @classmethod
    def default(cls) -> EmbeddingTarget:
        return cls(settings.MODEL_NAME, settings.MODEL_VERSION, dimensions=settings.EMBEDDING_SIZE)

    @classmethod
    def for_model(cls, model: EmbeddingModel) -> EmbeddingTarget:
        embedding_model_check(model)
        return cls(
            triton_model=model.triton_model,
            triton_version=model.triton_version,
            name=model.name,
            max_tokens=model.max_tokens,
            dimensions=model.dimensions,
            max_inputs=model.max_inputs_per_request or settings.MAX_INPUTS_PER_REQUEST,
            max_total_tokens=model.max_tokens_per_request or settings.MAX_TOKENS_PER_REQUEST,
            prompts=tuple(sorted((model.prompts or {}).items())),
            default_prompt_name=model.default_prompt_name,
            input_types=tuple(sorted((model.input_types or {}).items())),
        )

    @classmethod
    def for_ranking(cls, model: EmbeddingModel) -> EmbeddingTarget:
        """A rerank model's (a cross-encoder's): its pairs, one score each, no prompts."""
        if model.task != TASK_RERANK:
            raise UnsupportedByModel(f"The model {model.name!r} is not a cross-encoder.", param="model")
        return cls(
            triton_model=model.triton_model,
            triton_version=model.triton_version,
            name=model.name,
            max_tokens=model.max_tokens,
            dimensions=1,
            max_total_tokens=model.max_tokens_per_request or settings.MAX_TOKENS_PER_REQUEST,
        )

    def prompt(self, name: str | None, input_type: str | None = None) -> str:
        """The text to prepend for `name`, else for the prompt `input_type` maps to, else the default
        prompt; unknown names are refused, input types the model does not map embed as by default."""
        if input_type:
            mapped = dict(self.input_types).get(input_type_canonical(input_type))
            name = name or mapped
        name = name or self.default_prompt_name
        if not name:
            return ""
        for prompt_name, text in self.prompts:
            if prompt_name == name:
                return text
        known = ", ".join(prompt_name for prompt_name, _ in self.prompts) or "none"
        raise UnsupportedByModel(
            f"Unknown prompt_name {name!r}; this model's prompts: {known}", param="prompt_name"
        )


def input_type_canonical(input_type: str) -> str:
    """`input_type` in the catalog's words (Cohere's search_query is query); refused if unknown."""
    canonical = INPUT_TYPE_ALIASES.get(input_type, input_type)
    if canonical not in INPUT_TYPES:
        known = ", ".join([*INPUT_TYPES, *INPUT_TYPE_ALIASES])
        raise InvalidRequest(f"Unknown input_type {input_type!r}; input types: {known}", param="input_type")
    return canonical


def model_prompt_for(model: EmbeddingModel, input_type: str | None) -> str:
    """The prompt text a catalog model prepends to inputs of `input_type` (the one it maps, else its
    default prompt): what token estimates made before tokenising count (jobs, batch lines)."""
    mapped = (model.input_types or {}).get(input_type_canonical(input_type)) if input_type else None
    return (model.prompts or {}).get(mapped or model.default_prompt_name, "")


def embedding_model_check(model: EmbeddingModel) -> None:
    """Refuse a catalog model that makes no embeddings (a rerank model) for an embedding request."""
    if model.task != TASK_EMBED:
        raise UnsupportedByModel(
            f"The model {model.name!r} is a {model.task} model: it scores documents against a query "
            "(POST /v2/rerank, /v1/rerank or /rerank) and makes no embeddings.",
            param="model",
        )


@dataclass(frozen=True)
class EmbeddingOptions:
    truncate: bool = True
    direction: TruncationDirection = "right"
    # Keep the first N dimensions (Matryoshka-style), re-normalised when `normalize`.
    dimensions: int | None = None
    normalize: bool = True
    prompt_name: str | None = None
    # What the inputs are for (query, document, ...): picks the model's prompt for it, if it maps one.
    input_type: str | None = None
    # Texts keep at most this many tokens (below the model's maximum): one for all, or one per text.
    max_tokens: int | tuple[int, ...] | None = None
    # float, or quantised (int8, uint8, binary, ubinary: embeddings.services.inference.quantization).
    output_type: str = "float"
    # Embed an input longer than the model takes in chunks, aggregated (see the module docstring),
    # instead of truncating or refusing it (`truncate` and `direction` are then unused).
    chunk: bool = False


@dataclass(frozen=True)
class CacheHits:
    """What the embedding cache answered of one request: inputs (all of whose rows it held), their
    rows (texts or chunks) and those rows' tokens."""

    inputs: int = 0
    rows: int = 0
    tokens: int = 0
    # The same per input ([inputs, 3]: a hit or not, rows, tokens), for `between`; None without hits.
    per_input: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, batch: TokenizedBatch, cached: np.ndarray | None, chunk_starts: np.ndarray | None
    ) -> CacheHits:
        if cached is None or not cached.any():
            return NO_CACHE_HITS
        tokens = np.where(cached, batch.token_counts, 0)
        if chunk_starts is None:
            per_input = np.stack([cached, cached, tokens], axis=1)
        else:  # an input is a hit when every one of its chunks is
            starts = chunk_starts[:-1]
            per_input = np.stack(
                [
                    np.logical_and.reduceat(cached, starts),
                    np.add.reduceat(cached.astype(np.int64), starts),
                    np.add.reduceat(tokens, starts),
                ],
                axis=1,
            )
        return cls._summed(per_input.astype(np.int64))

    @classmethod
    def _summed(cls, per_input: np.ndarray) -> CacheHits:
        inputs, rows, tokens = (int(total) for total in per_input.sum(axis=0))
        return cls(inputs, rows, tokens, per_input) if rows else NO_CACHE_HITS

    def between(self, start: int, end: int) -> CacheHits:
        """What the cache answered of inputs `start` to `end` (excluded) alone: one of the requests
        a call embedded together (a batch's lines)."""
        return NO_CACHE_HITS if self.per_input is None else self._summed(self.per_input[start:end])


NO_CACHE_HITS = CacheHits()


@dataclass(frozen=True)
class EmbeddingResult:
    """Vectors in input order (float32 [n, dims]) and what producing them cost."""

    model: str
    vectors: np.ndarray
    token_counts: np.ndarray
    tokenization_s: float
    inference_s: float
    cache_hits: CacheHits = NO_CACHE_HITS

    @property
    def total_tokens(self) -> int:
        return int(self.token_counts.sum())

    @property
    def inputs(self) -> int:
        return len(self.token_counts)


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
) -> tuple[TokenizedBatch, np.ndarray | None, float]:
    """The request's rows, where each input's chunks start among them (None unless it is chunked),
    and the seconds it took."""
    with tracing.span("tokenize", model=target.triton_model):
        return _tokenize_timed(target, texts, token_ids, options)


def _tokenize_timed(
    target: EmbeddingTarget,
    texts: Sequence[str] | None,
    token_ids: Sequence[Sequence[int]] | None,
    options: EmbeddingOptions,
) -> tuple[TokenizedBatch, np.ndarray | None, float]:
    started = time.perf_counter()
    count = len(token_ids if token_ids is not None else texts or ())
    if target.max_inputs is not None and count > target.max_inputs:
        raise LimitExceeded(
            f"{count} inputs in one request; this model takes at most {target.max_inputs}", param="input"
        )
    tokenizer = model_tokenizer(target.triton_model, target.max_tokens, target.triton_version)
    starts = None
    if options.chunk:
        if token_ids is not None:
            raise InvalidRequest(
                "Token ids are not embedded in chunks (their special tokens are yours to place): send "
                "texts, or truncate or refuse long inputs",
                param="long_inputs",
            )
        chunked = tokenizer.encode_chunks(
            list(texts or ()),
            overlap=settings.CHUNK_OVERLAP_TOKENS,
            max_chunks=settings.MAX_CHUNKS_PER_INPUT,
            buckets=tuple(settings.SEQUENCE_LENGTH_BUCKETS),
        )
        batch, starts = chunked.batch, chunked.starts
        _chunks_check(target, chunked)
    elif token_ids is not None:
        batch = tokenizer.encode_ids(list(token_ids), truncate=options.truncate, direction=options.direction)
    else:
        batch = tokenizer.encode(
            list(texts or ()),
            truncate=options.truncate,
            direction=options.direction,
            buckets=tuple(settings.SEQUENCE_LENGTH_BUCKETS),
            max_tokens=options.max_tokens,
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
    return batch, starts, elapsed


def _chunks_check(target: EmbeddingTarget, chunked: ChunkedBatch) -> None:
    """A chunked request's rows are bounded as inputs are: at most the model's inputs per request."""
    rows = len(chunked.batch)
    if target.max_inputs is not None and rows > target.max_inputs:
        longest = int(np.argmax(chunked.chunk_counts))
        raise LimitExceeded(
            f"The {chunked.inputs} inputs make {rows} chunks in all (input {longest} has "
            f"{int(chunked.input_token_counts[longest])} tokens in {int(chunked.chunk_counts[longest])} "
            f"chunks); a request may have at most {target.max_inputs}",
            param="input",
        )


def chunks_aggregated(vectors: np.ndarray, token_counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each input's vector from its chunks' rows (input k's: `starts[k]:starts[k + 1]`): their mean
    weighted by each chunk's tokens, L2-normalised. An input of one chunk keeps its row as it is."""
    weighted = vectors.astype(np.float64) * token_counts[:, None]
    sums = np.add.reduceat(weighted, starts[:-1], axis=0)
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    aggregated = (sums / np.maximum(norms, 1e-12)).astype(np.float32)
    single = np.diff(starts) == 1
    aggregated[single] = vectors[starts[:-1][single]]
    return aggregated


def _input_vectors(batch: TokenizedBatch, starts: np.ndarray | None, vectors: np.ndarray) -> np.ndarray:
    """The rows' vectors as the inputs': their chunks' aggregated when chunked."""
    return vectors if starts is None else chunks_aggregated(vectors, batch.token_counts, starts)


def _input_token_counts(batch: TokenizedBatch, starts: np.ndarray | None) -> np.ndarray:
    """Each input's tokens: its chunks' together when chunked."""
    return batch.token_counts if starts is None else np.add.reduceat(batch.token_counts, starts[:-1])


def _takes_text(spec: ModelSpec, token_ids: object, *, chunked: bool = False) -> bool:
    """Whether the model takes text (one BYTES input) rather than token ids; checks seed settings.
    Chunks are token ids: a model that takes text cannot embed them."""
    if settings.INPUT_NAME and spec.input(settings.INPUT_NAME) is None:
        raise TritonModelError(f"model {spec.name!r} has no input named {settings.INPUT_NAME!r} (INPUT_NAME)")
    takes_text = any(tensor.datatype == "BYTES" for tensor in spec.inputs)
    if takes_text and token_ids is not None:
        raise InvalidRequest(
            f"model {spec.name!r} tokenises inside Triton and takes text, not token ids", param="input"
        )
    if takes_text and chunked:
        raise UnsupportedByModel(
            f"model {spec.name!r} tokenises inside Triton: it cannot embed long inputs in chunks "
            "(truncate or refuse them)",
            param="long_inputs",
        )
    return takes_text


def _with_prompt(
    target: EmbeddingTarget, texts: Sequence[str] | None, options: EmbeddingOptions
) -> Sequence[str] | None:
    prefix = target.prompt(options.prompt_name, options.input_type)
    if not prefix or texts is None:
        return texts
    return [prefix + text for text in texts]


def dimensions_check(*, dimensions: int | None, model_dimensions: int | None) -> None:
    """The `dimensions` a client asks for (requests and jobs): at least 1, at most the model's
    (when known)."""
    if dimensions is None:
        return
    if dimensions < 1:
        raise InvalidRequest("dimensions must be at least 1", param="dimensions")
    if model_dimensions and dimensions > model_dimensions:
        raise UnsupportedByModel(
            f"dimensions {dimensions} is larger than the model's {model_dimensions}", param="dimensions"
        )


def _check_options(target: EmbeddingTarget, options: EmbeddingOptions) -> None:
    dimensions_check(dimensions=options.dimensions, model_dimensions=target.dimensions)
    if options.input_type is not None:
        input_type_canonical(options.input_type)
    _calibration(target, options)  # an output type the model cannot give is refused before any work


def _calibration(target: EmbeddingTarget, options: EmbeddingOptions) -> Calibration | None:
    """The int8/uint8 ranges for the request's output (None for other types); refuses an output
    type the model's export cannot give (no calibration, or binary of a width not a multiple of 8)."""
    if options.output_type == "float":
        return None
    width = options.dimensions or target.dimensions
    if options.output_type in ("binary", "ubinary"):
        if width and width % 8:
            raise UnsupportedByModel(
                f"{options.output_type} packs 8 dimensions a byte; {width} is not a multiple of 8 "
                "(ask for dimensions that are)",
                param="output_dtype",
            )
        return None
    try:
        calibration = model_calibration(
            Path(settings.TRITON_MODEL_REPOSITORY),
            target.triton_model,
            target.triton_version,
            dimensions=options.dimensions,
            normalize=options.normalize,
        )
    except QuantizationError as error:
        raise UnsupportedByModel(str(error), param="output_dtype") from None
    except ModelExportError as error:  # its calibration vectors missing or replaced: a broken export
        raise _not_loaded(target) from error
    if calibration is None:
        raise UnsupportedByModel(
            f"The model {target.name or target.triton_model!r} has no int8 calibration (exported before "
            "output types were calibrated): re-export it, or ask for float, binary or ubinary.",
            param="output_dtype",
        )
    return calibration


def _postprocess(target: EmbeddingTarget, vectors: np.ndarray, options: EmbeddingOptions) -> np.ndarray:
    if target.dimensions and vectors.shape[1] != target.dimensions:
        raise TritonModelError(
            f"model {target.triton_model!r} returned {vectors.shape[1]}-d vectors, "
            f"{target.dimensions} expected"
        )
    if options.dimensions is not None:
        # A target without known dimensions is checked against what the model returned.
        dimensions_check(dimensions=options.dimensions, model_dimensions=vectors.shape[1])
        vectors = vectors[:, : options.dimensions]
        if options.normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, np.float32(1e-12))
    return vectors_as(target, np.ascontiguousarray(vectors, dtype=np.float32), options)


def vectors_as(target: EmbeddingTarget, vectors: np.ndarray, options: EmbeddingOptions) -> np.ndarray:
    """Float vectors (as a request with `options` gets them, `output_type` aside) in
    `options.output_type`: as they are for float, else quantised."""
    if options.output_type == "float":
        return vectors
    try:
        return quantized(vectors, options.output_type, _calibration(target, options))
    except QuantizationError as error:
        raise UnsupportedByModel(str(error), param="output_dtype") from None


def model_output_types(model: EmbeddingModel) -> list[str]:
    """The output types a catalog model gives (GET /v1/models): a rerank model none; int8/uint8 need
    an export calibrated for them, binary types a width that is a multiple of 8."""
    if model.task != TASK_EMBED:
        return []
    kinds = ["float"]
    calibration = model_calibration(
        Path(settings.TRITON_MODEL_REPOSITORY),
        model.triton_model,
        model.triton_version,
        dimensions=None,
        normalize=True,
    )
    if calibration is not None:
        kinds += ["int8", "uint8"]
    if model.dimensions % 8 == 0:
        kinds += ["binary", "ubinary"]
    return kinds


def output_type_check(target: EmbeddingTarget, options: EmbeddingOptions) -> None:
    """Refuse, before any work, an output type the model cannot give (embeddings_create does this
    for its own; a request answering several types checks the others)."""
    _calibration(target, options)


# Tokenising this many characters (or token ids) takes milliseconds: done in a thread, so the
# event loop keeps serving other requests meanwhile. Smaller inputs are cheaper than the hop.
TOKENIZE_IN_THREAD_ABOVE = 32_768


def _input_size(texts: Sequence[str] | None, token_ids: Sequence[Sequence[int]] | None) -> int:
    if token_ids is not None:
        return sum(len(ids) if isinstance(ids, list | tuple) else 1 for ids in token_ids)
    return sum(len(text) if isinstance(text, str) else 1 for text in texts or ())


def _plan(spec: ModelSpec, batch: TokenizedBatch) -> list[SubBatch]:
    return sub_batches(
        batch.token_counts,
        max_batch_tokens=settings.MAX_BATCH_TOKENS,
        max_rows=spec.max_batch_size,
        buckets=tuple(settings.SEQUENCE_LENGTH_BUCKETS),
    )


def _sub_batch_inputs(
    batch: TokenizedBatch, group: SubBatch
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The sub-batch's rows (ids, mask, and a pair batch's token types), padded to its own width
    (the batch is right-padded to its longest)."""
    types = batch.token_type_ids
    if len(group.rows) == len(batch) and group.width >= batch.input_ids.shape[1]:
        return batch.input_ids, batch.attention_mask, types
    width = group.width
    return (
        batch.input_ids[group.rows, :width],
        batch.attention_mask[group.rows, :width],
        None if types is None else types[group.rows, :width],
    )


async def _gather_or_cancel(calls: Sequence[Awaitable[np.ndarray]]) -> list[np.ndarray]:
    """Run the calls concurrently; the first failure (or our cancellation) cancels the rest."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


@contextlib.asynccontextmanager
async def _tokens_in_flight(tokens: int) -> AsyncIterator[None]:
    TOKENS_IN_FLIGHT.inc(tokens)
    try:
        yield
    finally:
        TOKENS_IN_FLIGHT.dec(tokens)


async def _infer(
    target: EmbeddingTarget,
    texts: Sequence[str] | None,
    token_ids: Sequence[Sequence[int]] | None,
    batch: TokenizedBatch,
    deadline: float,
    *,
    chunked: bool = False,
    cache_scope: str | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """All of the request's rows' full-width outputs, in input order, and which rows the embedding
    cache answered (None: not looked up): with `cache_scope` and EMBEDDING_CACHE on (and a model
    that takes token ids), those in the cache come from it and only the others from Triton
    (vector_cache.py)."""
    client = triton_async_client()
    spec = await client.model_metadata(target.triton_model, target.triton_version)
    takes_text = _takes_text(spec, token_ids, chunked=chunked)
    keys = _row_keys(target, batch, cache_scope, takes_text=takes_text)
    if keys is None:
        return await _infer_rows(target, spec, texts, batch, deadline, takes_text=takes_text), None
    found = await vectors_get(keys)
    missing = [row for row, vector in enumerate(found) if vector is None]
    computed = None
    if missing:
        computed = await _infer_rows(
            target, spec, texts, _batch_rows(batch, missing), deadline, takes_text=False
        )
        await vectors_put([keys[row] for row in missing], computed)
    return _rows_filled(found, missing, computed)


def _row_keys(
    target: EmbeddingTarget, batch: TokenizedBatch, cache_scope: str | None, *, takes_text: bool
) -> list[bytes] | None:
    """The embedding cache's key of each of the batch's rows under `cache_scope`; None when its rows
    are not cached (no scope, EMBEDDING_CACHE off, a model that takes text or without a recorded
    export checksum)."""
    if cache_scope is None or not settings.EMBEDDING_CACHE or takes_text:
        return None
    served = served_model(target.triton_model, target.triton_version)
    if served is None:
        return None
    return [
        served.row_key(cache_scope, ids[mask.astype(bool)])
        for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)
    ]


def _rows_filled(
    found: list[np.ndarray | None], missing: list[int], computed: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Every row's vector, in order (the cache's, and the `missing` rows' `computed` ones), and
    which rows the cache answered."""
    cached = np.ones(len(found), dtype=bool)
    cached[missing] = False
    for position, row in enumerate(missing):
        found[row] = computed[position]
    return np.stack(found).astype(np.float32, copy=False), cached


def _batch_rows(batch: TokenizedBatch, rows: list[int]) -> TokenizedBatch:
    """The batch's `rows` alone (a cache's misses), in that order."""
    if len(rows) == len(batch):
        return batch
    return TokenizedBatch(
        input_ids=batch.input_ids[rows],
        attention_mask=batch.attention_mask[rows],
        token_counts=batch.token_counts[rows],
        truncated=batch.truncated[rows],
        token_type_ids=None if batch.token_type_ids is None else batch.token_type_ids[rows],
    )


async def _infer_rows(
    target: EmbeddingTarget,
    spec: ModelSpec,
    texts: Sequence[str] | None,
    batch: TokenizedBatch,
    deadline: float,
    *,
    takes_text: bool,
) -> np.ndarray:
    """All of the batch's sub-batches through the process's fair scheduler, by `deadline`."""
    client = triton_async_client()
    model, version = target.triton_model, target.triton_version
    groups = _plan(spec, batch)
    scheduler = inference_scheduler()
    share = scheduler.share()

    coalesce = settings.COALESCE_REQUESTS and not takes_text and len(groups) == 1 and spec.max_batch_size > 0

    async def run(group: SubBatch) -> np.ndarray:
        queued = time.perf_counter()
        async with scheduler.slot(share, group.cost), _tokens_in_flight(group.cost):
            if coalesce:
                # Shares one Triton call with other requests' rows (inference/coalescing.py).
                coalescer = request_coalescer(model, version, max_rows=spec.max_batch_size)
                input_ids, attention_mask, token_type_ids = _sub_batch_inputs(batch, group)
                return await coalescer.embed(
                    input_ids, attention_mask, token_type_ids=token_type_ids, deadline=deadline, queued=queued
                )
            QUEUE_SECONDS.labels(model).observe(time.perf_counter() - queued)
            BATCH_ROWS.labels(model).observe(len(group.rows))
            BATCH_TOKENS.labels(model).observe(group.cost)
            options = {
                "version": version,
                "output_name": settings.OUTPUT_NAME,
                "priority": PRIORITY_INTERACTIVE if len(groups) == 1 else PRIORITY_LARGE,
                # Each call within TRITON_TIMEOUT_S, and none past the request's deadline.
                "timeout_s": max(0.001, min(settings.TRITON_TIMEOUT_S, deadline - time.monotonic())),
            }
            if takes_text:
                rows = [texts[row] for row in group.rows] if len(groups) > 1 else list(texts or ())
                return await client.embed_texts(model, rows, **options)
            input_ids, attention_mask, token_type_ids = _sub_batch_inputs(batch, group)
            return await client.embed_tokens(
                model, input_ids, attention_mask, token_type_ids=token_type_ids, **options
            )

    parts = [await run(groups[0])] if len(groups) == 1 else await _gather_or_cancel(map(run, groups))
    return reassembled(list(zip(groups, parts, strict=True)), len(batch))


async def embeddings_create(
    *,
    target: EmbeddingTarget,
    texts: Sequence[str] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    options: EmbeddingOptions = EmbeddingOptions(),
    quota: RequestQuota | None = None,
    timeout_s: float | None = None,
    cache_scope: str | None = None,
) -> EmbeddingResult:
    """Embed `texts` (or pre-tokenised `token_ids`) with the target model, in input order.

    With `quota`, the request's tokens are reserved against its tenant's and key's limits after
    tokenisation and before inference (QuotaExceeded refuses it with nothing spent), and settled
    afterwards: kept when it succeeded, refunded when inference failed.

    Inference (waiting for its turn included) ends within `timeout_s` (EMBEDDING_TIMEOUT_S) of
    the call: past it InferenceTimeout is raised at once, and the sub-batches not yet sent are
    never sent. A cancelled call (the client went away) drops them likewise.

    `cache_scope` (the caller's tenant id) lets its rows come from and go to the embedding cache
    when EMBEDDING_CACHE is on (vector_cache.py); None: no caching. Quotas and usage count every
    row's tokens, cached or not.
    """
    timeout_s = settings.EMBEDDING_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    _check_options(target, options)
    texts = _with_prompt(target, texts, options)
    if _input_size(texts, token_ids) > TOKENIZE_IN_THREAD_ABOVE:
        batch, starts, tokenization_s = await asyncio.to_thread(_tokenize, target, texts, token_ids, options)
    else:
        batch, starts, tokenization_s = _tokenize(target, texts, token_ids, options)
    vectors, inference_s, cache_hits = await tokens_infer(
        target,
        batch,
        deadline=deadline,
        timeout_s=timeout_s,
        quota=quota,
        finish=lambda vectors: _postprocess(target, _input_vectors(batch, starts, vectors), options),
        texts=texts,
        token_ids=token_ids,
        chunk_starts=starts,
        cache_scope=cache_scope,
    )
    token_counts = _input_token_counts(batch, starts)
    return EmbeddingResult(
        target.triton_model, vectors, token_counts, tokenization_s, inference_s, cache_hits
    )


async def tokens_infer(
    target: EmbeddingTarget,
    batch: TokenizedBatch,
    *,
    deadline: float,
    timeout_s: float,
    quota: RequestQuota | None,
    finish: Callable[[np.ndarray], np.ndarray],
    texts: Sequence[str] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    chunk_starts: np.ndarray | None = None,
    cache_scope: str | None = None,
) -> tuple[np.ndarray, float, CacheHits]:
    """A tokenised request's model outputs, `finish`ed, the inference seconds and what the embedding
    cache answered (`cache_scope`, as for embeddings_create): metered (its
    quota reserved before, settled after: kept on success, refunded on any failure, `finish`'s
    included), within the in-flight gate and by `deadline` (`timeout_s` from the request's start).
    Embeddings and a cross-encoder's pair scores alike. With `chunk_starts` the rows are the
    inputs' chunks (input k's from chunk_starts[k]): the inputs are counted as the client sent them,
    and every chunk's tokens."""
    inputs = len(batch) if chunk_starts is None else len(chunk_starts) - 1
    request_context.annotate(inputs=inputs, tokens=batch.total_tokens)
    with inflight_gate:
        if quota is not None:
            with tracing.span("quota.reserve"):
                await quota.reserve(inputs=inputs, tokens=batch.total_tokens)
        try:
            with triton_call_observed(target.triton_model):
                started = time.perf_counter()
                try:
                    async with asyncio.timeout(deadline - time.monotonic()):
                        with tracing.span("inference", model=target.triton_model, rows=len(batch)):
                            vectors, cached = await _infer(
                                target,
                                texts,
                                token_ids,
                                batch,
                                deadline,
                                chunked=chunk_starts is not None,
                                cache_scope=cache_scope,
                            )
                except TritonModelNotLoaded as error:
                    raise _not_loaded(target) from error
                except TimeoutError:
                    raise InferenceTimeout(
                        f"The model's answer was not ready within this server's {timeout_s:g} s deadline "
                        f"({len(batch)} inputs, {batch.total_tokens} tokens); send fewer or shorter "
                        "inputs per request, or retry when the server is less busy."
                    ) from None
                inference_s = time.perf_counter() - started
            vectors = finish(vectors)
            hits = CacheHits.of(batch, cached, chunk_starts)
        except BaseException:  # a Triton error, a bad output, the deadline, or the client went away
            if quota is not None:
                with tracing.span("quota.settle", succeeded=False):
                    await quota.settle(succeeded=False)
            raise
    if cached is not None:
        request_context.annotate(cache_hits=hits.rows)
    if quota is not None:
        with tracing.span("quota.settle", succeeded=True):
            await quota.settle(succeeded=True, cached_inputs=hits.inputs, cached_tokens=hits.tokens)
    return vectors, inference_s, hits


def _not_loaded(target: EmbeddingTarget) -> ModelNotLoaded:
    return ModelNotLoaded(
        model=target.name or target.triton_model,
        triton_model=target.triton_model,
        version=target.triton_version,
    )


@contextlib.contextmanager
def _model_not_loaded_named(target: EmbeddingTarget) -> Iterator[None]:
    """Triton's "not loaded" as the service's error, naming the catalog model the client asked for."""
    try:
        yield
    except TritonModelNotLoaded as error:
        raise _not_loaded(target) from error


def _run_windowed(calls: Sequence[Callable[[], np.ndarray]], window: int) -> list[np.ndarray]:
    """Run blocking calls with at most `window` at a time, in order; a failure cancels the rest."""
    if len(calls) == 1 or window <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(min(window, len(calls)), thread_name_prefix="embed-sub-batch") as pool:
        futures = [pool.submit(call) for call in calls]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def embeddings_create_sync(
    *,
    target: EmbeddingTarget,
    texts: Sequence[str] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    options: EmbeddingOptions = EmbeddingOptions(),
    cache_scope: str | None = None,
) -> EmbeddingResult:
    """The blocking twin of `embeddings_create`, for Celery workers and commands (no in-flight gate).

    Its sub-batches go to Triton at the bulk priority, MAX_TOKENS_IN_FLIGHT / MAX_BATCH_TOKENS at a
    time, so queued bulk work never stands in front of a request someone is waiting for. With
    `cache_scope` (a job's tenant's) its rows come from and go to the embedding cache as
    `embeddings_create`'s do: only the misses are sent, and the result says what was a hit.
    """
    _check_options(target, options)
    texts = _with_prompt(target, texts, options)
    batch, starts, tokenization_s = _tokenize(target, texts, token_ids, options)
    client = triton_sync_client()
    model, version = target.triton_model, target.triton_version
    with (
        triton_call_observed(model),
        _model_not_loaded_named(target),
        tracing.span("inference", model=model, rows=len(batch)),
    ):
        started = time.perf_counter()
        spec = client.model_metadata(model, version)
        takes_text = _takes_text(spec, token_ids, chunked=starts is not None)
        keys = _row_keys(target, batch, cache_scope, takes_text=takes_text)
        cached = None
        if keys is None:
            vectors = _infer_rows_sync(target, spec, texts, batch, takes_text=takes_text)
        else:
            found = vectors_get_sync(keys)
            missing = [row for row, vector in enumerate(found) if vector is None]
            computed = None
            if missing:
                computed = _infer_rows_sync(
                    target, spec, texts, _batch_rows(batch, missing), takes_text=False
                )
                vectors_put_sync([keys[row] for row in missing], computed)
            vectors, cached = _rows_filled(found, missing, computed)
        inference_s = time.perf_counter() - started
    vectors = _postprocess(target, _input_vectors(batch, starts, vectors), options)
    return EmbeddingResult(
        model,
        vectors,
        _input_token_counts(batch, starts),
        tokenization_s,
        inference_s,
        CacheHits.of(batch, cached, starts),
    )


def _infer_rows_sync(
    target: EmbeddingTarget,
    spec: ModelSpec,
    texts: Sequence[str] | None,
    batch: TokenizedBatch,
    *,
    takes_text: bool,
) -> np.ndarray:
    """All of the batch's sub-batches, a window of them at a time, at the bulk priority."""
    client = triton_sync_client()
    model = target.triton_model
    groups = _plan(spec, batch)
    call_options = {
        "version": target.triton_version,
        "output_name": settings.OUTPUT_NAME,
        "priority": PRIORITY_BULK,
    }

    def call(group: SubBatch) -> Callable[[], np.ndarray]:
        if takes_text:
            rows = [texts[row] for row in group.rows] if len(groups) > 1 else list(texts or ())
            return lambda: client.embed_texts(model, rows, **call_options)
        input_ids, attention_mask, token_type_ids = _sub_batch_inputs(batch, group)
        return lambda: client.embed_tokens(
            model, input_ids, attention_mask, token_type_ids=token_type_ids, **call_options
        )

    window = max(1, settings.MAX_TOKENS_IN_FLIGHT // settings.MAX_BATCH_TOKENS)
    parts = _run_windowed([call(group) for group in groups], window)
    return reassembled(list(zip(groups, parts, strict=True)), len(batch))
