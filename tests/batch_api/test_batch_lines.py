"""A batch chunk's lines without Triton: grouping, the per-request limits each line is held to, and the
line reader's bound on an overlong line. The embedding call is a fake here (the boundary); the
SDK tests run the same code on the real stack."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from embeddings.errors.service import InvalidRequest, LimitExceeded
from embeddings.models import EmbeddingModel
from embeddings.services.inference.catalog import embedding_model_cache_clear
from embeddings.services.inference.embedding import CacheHits, EmbeddingResult
from embeddings.services.openai_api import batch_lines
from embeddings.services.openai_api.batch_lines import LineRequest, batch_chunk_embed
from embeddings.services.openai_api.batches import _lines
from embeddings.services.quotas.usage import parse_usage_field
from tests.conftest import write_finished_export

pytestmark = pytest.mark.unit

MODEL = EmbeddingModel(
    name="m",
    triton_model="m",
    dimensions=4,
    max_tokens=16,
    max_inputs_per_request=3,
    max_tokens_per_request=10,
)


def line(custom_id: str, texts: list[str], **options) -> LineRequest:
    return LineRequest(
        custom_id=custom_id,
        model="m",
        texts=texts,
        token_ids=None,
        dimensions=options.get("dimensions"),
        encoding_format=options.get("encoding_format", "float"),
        output_type=options.get("output_type", "float"),
        input_type=options.get("input_type"),
    )


class FakeEmbedding:
    """Each text's vector is its length repeated; each text costs len(text) tokens; a text "bad"
    is refused as a model refuses an input; with a cache scope, a text that starts with "cached:"
    is a hit of the embedding cache. Records every call's texts, limits and cache scope."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int | None, int | None]] = []
        self.options = []
        self.scopes: list[str | None] = []

    def __call__(self, *, target, texts=None, token_ids=None, options, cache_scope=None):
        self.calls.append((list(texts), target.max_inputs, target.max_total_tokens))
        self.options.append(options)
        self.scopes.append(cache_scope)
        if target.max_inputs is not None and len(texts) > target.max_inputs:
            raise LimitExceeded(f"{len(texts)} inputs in one request", param="input")
        if "bad" in texts:
            raise InvalidRequest("bad input", param="input")
        counts = np.array([len(text) for text in texts])
        if target.max_total_tokens is not None and counts.sum() > target.max_total_tokens:
            raise LimitExceeded(f"{counts.sum()} tokens", param="input")
        width = options.dimensions or 4
        vectors = np.repeat(counts[:, None].astype(np.float32), width, axis=1)
        if options.output_type == "int8":
            vectors = vectors.astype(np.int8)
        cached = None if cache_scope is None else np.array([text.startswith("cached:") for text in texts])
        hits = CacheHits.of(SimpleNamespace(token_counts=counts), cached, None)
        return EmbeddingResult("m", vectors, counts, 0.0, 0.0, hits)


def render(error: Exception) -> tuple[int, dict]:
    status = 413 if isinstance(error, LimitExceeded) else 422
    return status, {
        "error": {"message": str(error), "type": "invalid_request_error", "param": "input", "code": "x"}
    }


def run(
    monkeypatch, lines: list[LineRequest], **options
) -> tuple[list[dict], FakeEmbedding, batch_lines.ChunkOutput]:
    fake = FakeEmbedding()
    monkeypatch.setattr(batch_lines, "embeddings_create_sync", fake)
    output = batch_chunk_embed(
        lines=lines, models={"m": MODEL}, tenant_id=1, api_key_id=None, render_error=render, **options
    )
    return [orjson.loads(raw) for raw in output.payload.splitlines()], fake, output


def test_lines_of_one_kind_share_one_call_and_keep_their_order(monkeypatch):
    lines = [
        line("a", ["xx"]),
        line("b", ["yyy", "z"], dimensions=2),
        line("c", ["w"], encoding_format="base64"),
    ]
    records, fake, output = run(monkeypatch, lines)
    assert [record["custom_id"] for record in records] == ["a", "b", "c"]
    # One call per (model, dimensions, kind), without the per-request limits.
    assert fake.calls == [(["xx", "w"], None, None), (["yyy", "z"], None, None)]
    assert records[0]["response"]["body"]["data"][0]["embedding"] == [2.0] * 4
    assert records[1]["response"]["body"]["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert isinstance(records[2]["response"]["body"]["data"][0]["embedding"], str)
    assert (output.succeeded, output.tokens) == (3, 7)
    requests = {
        name: amount for name, amount in output.usage.items() if parse_usage_field(name)[1] == "requests"
    }
    assert list(requests.values()) == [3]


def test_a_chunks_usage_records_the_variant_serving_its_model(monkeypatch, settings, tmp_path):
    settings.TRITON_MODEL_REPOSITORY = str(tmp_path)
    write_finished_export(tmp_path, version=2, extra={"dtype": "int8"})
    pinned = EmbeddingModel(name="m", triton_model="minilm", triton_version="2", dimensions=4, max_tokens=16)
    embedding_model_cache_clear()
    fake = FakeEmbedding()
    monkeypatch.setattr(batch_lines, "embeddings_create_sync", fake)
    output = batch_chunk_embed(
        lines=[line("a", ["xx"]), line("b", ["y"])], models={"m": pinned}, tenant_id=1, api_key_id=None
    )
    counted = {parse_usage_field(name): amount for name, amount in output.usage.items()}
    assert {(bucket.endpoint, bucket.model_version, bucket.model_dtype) for bucket, _ in counted} == {
        ("batches", "2", "int8")
    }
    assert [amount for (_, metric), amount in counted.items() if metric == "requests"] == [2]


def test_lines_of_other_output_or_input_types_never_share_a_call(monkeypatch):
    lines = [
        line("float", ["aa"]),
        line("int8", ["bbb"], output_type="int8"),
        line("query", ["c"], input_type="query"),
        line("int8-too", ["dddd"], output_type="int8"),
        line("int8-base64", ["ee"], output_type="int8", encoding_format="base64"),
    ]
    records, fake, _ = run(monkeypatch, lines)
    assert [call[0] for call in fake.calls] == [["aa"], ["bbb", "dddd", "ee"], ["c"]]
    assert [(o.output_type, o.input_type) for o in fake.options] == [
        ("float", None),
        ("int8", None),
        ("float", "query"),
    ]
    bodies = {record["custom_id"]: record["response"]["body"] for record in records}
    assert bodies["float"]["data"][0]["embedding"] == [2.0] * 4
    assert bodies["int8"]["data"][0]["embedding"] == [3] * 4  # integers, as /v1/embeddings gives them
    assert bodies["int8-base64"]["data"][0]["embedding"] == "AgICAg=="  # four int8 bytes of 2


def test_a_stored_line_without_output_or_input_type_reads_as_float():
    stored = orjson.loads(line("old", ["x"]).encode())
    del stored["output_type"], stored["input_type"]
    old = LineRequest.decode(orjson.dumps(stored).decode())
    assert (old.output_type, old.input_type) == ("float", None)


def test_a_line_over_a_request_limit_gets_the_answer_it_would_get_alone(monkeypatch):
    lines = [
        line("ok", ["aa"]),
        line("wide", ["a", "b", "c", "d"]),
        line("long", ["x" * 11]),
        line("fine", ["b"]),
    ]
    records, fake, output = run(monkeypatch, lines)
    by_id = {record["custom_id"]: record for record in records}
    assert [record["custom_id"] for record in records] == ["ok", "wide", "long", "fine"]
    assert by_id["wide"]["response"]["status_code"] == 413  # more inputs than a request may have
    assert by_id["long"]["response"]["status_code"] == 413  # more tokens than a request may have
    assert by_id["ok"]["response"]["status_code"] == by_id["fine"]["response"]["status_code"] == 200
    # Each refused line was asked alone, with the request's own limits.
    assert (["a", "b", "c", "d"], 3, 10) in fake.calls and (["x" * 11], 3, 10) in fake.calls
    assert output.succeeded == 2


def test_a_refused_input_fails_its_line_only(monkeypatch):
    records, _, output = run(monkeypatch, [line("a", ["x"]), line("b", ["bad"]), line("c", ["y"])])
    assert [record["response"]["status_code"] for record in records] == [200, 422, 200]
    assert records[1]["response"]["body"]["error"]["message"] == "bad input" and records[1]["error"] is None
    assert output.succeeded == 2


def usage_totals(output: batch_lines.ChunkOutput) -> dict[str, int]:
    """The chunk's usage increments summed by metric (one model here)."""
    totals: dict[str, int] = {}
    for name, amount in output.usage.items():
        _, metric = parse_usage_field(name)
        totals[metric] = totals.get(metric, 0) + amount
    return totals


def test_each_line_counts_what_the_cache_answered_of_it_alone(monkeypatch):
    lines = [
        line("part", ["cached:a", "b"]),  # 9 tokens, one input of two a hit (8 tokens)
        line("whole", ["cached:c"]),  # 8 tokens, all a hit
        line("none", ["d"]),
        line("long", ["cached:" + "x" * 5]),  # a hit in the group's call, but refused alone
    ]
    records, fake, output = run(monkeypatch, lines, cache_scope=lambda model: f"scope of {model.name}")
    assert [record["response"]["status_code"] for record in records] == [200, 200, 200, 413]
    assert set(fake.scopes) == {"scope of m"}  # the group's call and the refused line's alone
    assert (output.succeeded, output.tokens, output.cached_tokens) == (3, 18, 16)
    totals = usage_totals(output)
    assert (totals["inputs"], totals["tokens"]) == (4, 18)
    assert (totals["cached_inputs"], totals["cached_tokens"]) == (2, 16)


def test_without_a_cache_scope_no_line_reads_the_cache(monkeypatch):
    _, fake, output = run(monkeypatch, [line("a", ["cached:a"]), line("b", ["b"])])
    assert fake.scopes == [None] and output.cached_tokens == 0
    assert "cached_inputs" not in usage_totals(output)


def test_the_line_reader_never_holds_an_overlong_line():
    data = b'{"a": 1}\n' + b"x" * 5000 + b"\n\n" + b"last"
    reads = []

    class Counting(io.BytesIO):
        def readline(self, size=-1):
            reads.append(size)
            return super().readline(size)

    assert list(_lines(Counting(data), 100)) == [(1, b'{"a": 1}\n'), (2, None), (3, b"\n"), (4, b"last")]
    assert all(0 < size <= 1 << 20 for size in reads)
