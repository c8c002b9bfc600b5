"""A batch's lines on the job engine: one line's request as a job input, and a chunk of lines embedded
into OpenAI's output lines.

Each job input of a batch is one validated line (`LineRequest`, stored as JSON). A chunk embeds its
lines grouped by model, dimensions, kind of input, output type and input type, one embedding call
per group, so that no line is embedded with another line's options (the job
engine's blocking path), and splits the vectors back per line; each line's `response.body` is built
by `embeddings_response_body`, as POST /v1/embeddings builds its answer. A line the group call
cannot serve as that request alone would be served (more inputs or tokens than one request may
have, an input the model refuses) is embedded again alone with the request's own limits, so it
gets exactly the answer (or the error) the synchronous API gives: a line's body is read by the
embeddings request's own contract (embeddings/contracts/) and its errors rendered from the one
error table (embeddings/errors/answers.py), as the endpoint reads and answers them.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import orjson

from embeddings.errors.answers import as_api_error
from embeddings.errors.service import InvalidRequest, LimitExceeded
from embeddings.models import EmbeddingModel
from embeddings.services.inference.catalog import embedding_model_variant
from embeddings.services.inference.embedding import (
    CacheHits,
    EmbeddingOptions,
    EmbeddingTarget,
    embeddings_create_sync,
    model_prompt_for,
)
from embeddings.services.openai_api.embeddings_body import embeddings_response_body
from embeddings.services.quotas.usage import UsageEvent, parse_usage_field, usage_increments
from embeddings.tokenization import TokenizationError
from embeddings.triton import TritonInvalidInput

# An exception -> (HTTP status, OpenAI error body), as the API would answer it.
RenderError = Callable[[Exception], tuple[int, dict]]
# A model -> the embedding cache scope of the batch's tenant for it.
CacheScope = Callable[[EmbeddingModel], str]
# Errors that belong to one request's inputs: that line gets an error answer, the others go on.
# Anything else (Triton down, a timeout) propagates: the chunk is retried as any job chunk.
LINE_ERRORS = (InvalidRequest, LimitExceeded, TokenizationError, TritonInvalidInput)
LINE_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def line_error_render(error: Exception) -> tuple[int, dict]:
    """The status and OpenAI error body the API answers `error` with; the line's own request id is
    beside it, in its response (not that of the request that created the batch)."""
    answer = as_api_error(error)
    return answer.status, answer.body(with_request_id=False)


@dataclass(frozen=True)
class LineRequest:
    """One validated line: its custom_id and the embeddings request of its body."""

    custom_id: str
    model: str  # the catalog model's name, resolved when validating
    texts: list[str] | None
    token_ids: list[list[int]] | None
    dimensions: int | None
    encoding_format: str
    # Voyage's output_dtype and input_type (defaults: lines stored before they were kept).
    output_type: str = "float"
    input_type: str | None = None

    @property
    def inputs(self) -> int:
        return len(self.token_ids if self.token_ids is not None else self.texts or ())

    def encode(self) -> str:
        return orjson.dumps(dataclasses.asdict(self)).decode()

    @classmethod
    def decode(cls, raw: str) -> LineRequest:
        return cls(**orjson.loads(raw))


def line_token_estimate(line: LineRequest, model: EmbeddingModel) -> int:
    """An upper bound of the line's tokens without tokenising (as jobs estimate theirs)."""
    cap = model.max_tokens
    if line.token_ids is not None:
        return sum(min(cap, len(ids)) for ids in line.token_ids)
    prompt = len(model_prompt_for(model, line.input_type).encode())
    return sum(min(cap, len(text.encode()) + prompt + 2) for text in line.texts or ())


def line_output_bytes_estimate(line: LineRequest, model: EmbeddingModel) -> int:
    """About how many bytes the line's output takes: a float in JSON ~14 bytes, in base64 ~5.4; a
    quantised value (int8, uint8, or a packed byte of eight binary dimensions) in JSON at most 5, in
    base64 ~1.4."""
    dims = line.dimensions or model.dimensions
    if line.output_type in ("binary", "ubinary"):
        dims = -(-dims // 8)
    if line.output_type == "float":
        per_value = 6 if line.encoding_format == "base64" else 14
    else:
        per_value = 2 if line.encoding_format == "base64" else 5
    return line.inputs * dims * per_value + 400 + len(line.custom_id)


def new_request_ids() -> tuple[str, str]:
    """A line's `id` and its response's `request_id`."""
    return "batch_req_" + secrets.token_hex(16), "req_" + secrets.token_hex(16)


def output_line(custom_id: str, status_code: int, body: dict) -> bytes:
    line_id, request_id = new_request_ids()
    if status_code >= 400 and isinstance(body.get("error"), dict):
        # As the API puts a request's id in its error body: this line's own.
        body = {**body, "error": {**body["error"], "request_id": request_id}}
    record = {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }
    return orjson.dumps(record, option=LINE_DUMPS_OPTIONS)


def error_line(custom_id: str | None, code: str, message: str) -> bytes:
    """A line that got no response (refused while validating, cancelled, expired, failed)."""
    record = {
        "id": new_request_ids()[0],
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return orjson.dumps(record, option=LINE_DUMPS_OPTIONS)


@dataclass
class ChunkOutput:
    """A chunk's output lines (JSONL, input order), how many succeeded, their tokens (of which those
    the embedding cache answered) and usage."""

    lines: list[bytes] = field(default_factory=list)
    succeeded: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    usage: dict[str, int] = field(default_factory=dict)

    @property
    def payload(self) -> bytes:
        return b"".join(self.lines)


def _line_body(line: LineRequest, vectors: np.ndarray, tokens: int) -> dict:
    return embeddings_response_body(
        model_name=line.model, vectors=vectors, total_tokens=tokens, encoding_format=line.encoding_format
    )


def _embed(target: EmbeddingTarget, lines: list[LineRequest], cache_scope: str | None):
    first = lines[0]
    options = EmbeddingOptions(
        dimensions=first.dimensions, output_type=first.output_type, input_type=first.input_type
    )
    if first.token_ids is not None:
        ids = [ids for line in lines for ids in line.token_ids]
        return embeddings_create_sync(target=target, token_ids=ids, options=options, cache_scope=cache_scope)
    texts = [text for line in lines for text in line.texts]
    return embeddings_create_sync(target=target, texts=texts, options=options, cache_scope=cache_scope)


def batch_chunk_embed(
    *,
    lines: list[LineRequest],
    models: dict[str, EmbeddingModel],
    tenant_id: int,
    api_key_id: int | None,
    render_error: RenderError = line_error_render,
    cache_scope: CacheScope | None = None,
) -> ChunkOutput:
    """Embed a chunk's lines: one output line each, in order (see the module docstring). Their rows
    come from and go to the embedding cache under `cache_scope(model)`, and each line's usage
    counts what the cache answered of it."""
    answers: list[bytes | None] = [None] * len(lines)
    tally: dict[str, list[int]] = {}  # model -> [requests, inputs, tokens, cached inputs, cached tokens]
    started = time.perf_counter()

    def succeed(index: int, vectors: np.ndarray, tokens: int, hits: CacheHits) -> None:
        line = lines[index]
        answers[index] = output_line(line.custom_id, 200, _line_body(line, vectors, tokens))
        counts = tally.setdefault(line.model, [0, 0, 0, 0, 0])
        for position, amount in enumerate((1, line.inputs, tokens, hits.inputs, hits.tokens)):
            counts[position] += amount

    def alone(index: int, target: EmbeddingTarget, scope: str | None) -> None:
        line = lines[index]
        try:
            result = _embed(target, [line], scope)
        except LINE_ERRORS as error:
            status, body = render_error(error)
            answers[index] = output_line(line.custom_id, status, body)
            return
        succeed(index, result.vectors, result.total_tokens, result.cache_hits)

    groups: dict[tuple, list[int]] = {}
    for index, line in enumerate(lines):
        key = (line.model, line.dimensions, line.token_ids is None, line.output_type, line.input_type)
        groups.setdefault(key, []).append(index)
    for (model_name, *_), indexes in groups.items():
        request_target = EmbeddingTarget.for_model(models[model_name])
        scope = None if cache_scope is None else cache_scope(models[model_name])
        # The group's call has no per-request limits; each line is held to them below.
        group_target = dataclasses.replace(request_target, max_inputs=None, max_total_tokens=None)
        fits = [i for i in indexes if lines[i].inputs <= (request_target.max_inputs or lines[i].inputs)]
        for index in sorted(set(indexes) - set(fits)):
            alone(index, request_target, scope)
        if not fits:
            continue
        try:
            result = _embed(group_target, [lines[i] for i in fits], scope)
        except LINE_ERRORS:
            # Some line's input is refused: each line alone gets its own answer.
            for index in fits:
                alone(index, request_target, scope)
            continue
        start = 0
        for index in fits:
            end = start + lines[index].inputs
            tokens = int(result.token_counts[start:end].sum())
            limit = request_target.max_total_tokens
            if limit is not None and tokens > limit:
                alone(index, request_target, scope)  # refused as the request alone is refused
            else:
                succeed(index, result.vectors[start:end], tokens, result.cache_hits.between(start, end))
            start = end
    output = ChunkOutput(lines=[answer for answer in answers if answer is not None])
    latency_ms = round((time.perf_counter() - started) * 1000)
    for model_name, (requests, inputs, tokens, cached_inputs, cached_tokens) in tally.items():
        output.succeeded += requests
        output.tokens += tokens
        output.cached_tokens += cached_tokens
        variant = embedding_model_variant(model=models[model_name])
        event = UsageEvent(
            tenant_id=tenant_id,
            api_key_id=api_key_id,
            model=model_name,
            model_version=variant.version,
            model_dtype=variant.dtype,
            endpoint="batches",
            outcome="succeeded",
            inputs=inputs,
            tokens=tokens,
            latency_ms=latency_ms,
            cached_inputs=cached_inputs,
            cached_tokens=cached_tokens,
        )
        for name, amount in usage_increments(event).items():
            # One event per model stands for `requests` requests: each line counts as one.
            if parse_usage_field(name)[1] in ("requests", "succeeded"):
                amount = requests
            output.usage[name] = output.usage.get(name, 0) + amount
    return output
