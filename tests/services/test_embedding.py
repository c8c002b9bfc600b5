"""The embedding service end to end: service tokenizer -> pooled client -> real Triton -> vectors."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import orjson
import pytest
from django.core.management import CommandError, call_command

from embeddings.errors.service import (
    InferenceTimeout,
    InvalidRequest,
    ModelNotLoaded,
    Overloaded,
    UnsupportedByModel,
)
from embeddings.services.inference import embedding
from embeddings.services.inference.clients import model_tokenizer
from embeddings.services.inference.embedding import EmbeddingOptions, EmbeddingTarget
from embeddings.tokenization import InputTooLong, InvalidText
from embeddings.tooling.triton_server import free_port
from embeddings.triton import TritonModelError, TritonTimeout, TritonUnavailable
from tests import onnx_reference
from tests.conftest import start_triton

MINILM = EmbeddingTarget("minilm", dimensions=384)


async def embeddings_create(*, texts, model="minilm", truncate=True, **options):
    return await embedding.embeddings_create(
        target=EmbeddingTarget(model), texts=texts, options=EmbeddingOptions(truncate=truncate, **options)
    )


def embeddings_create_sync(*, texts, model="minilm"):
    return embedding.embeddings_create_sync(target=EmbeddingTarget(model), texts=texts)


SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome",
    "",
    "   ",
    "Ünïcödé text, 日本語のテキスト, and emoji 🚀",
    "Triton batches requests of different lengths together " * 12,
    "short",
]


@pytest.fixture(scope="module")
def reference_session() -> ort.InferenceSession:
    return onnx_reference.reference_session()


def reference_vectors(session: ort.InferenceSession, texts: list[str]) -> np.ndarray:
    """In-process ONNX Runtime on the same model.onnx, one text at a time (no padding at all)."""
    tokenizer = model_tokenizer("minilm")
    rows = []
    for text in texts:
        batch = tokenizer.encode([text])
        rows.append(
            session.run(None, {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})[0][0]
        )
    return np.stack(rows)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


async def test_async_embeddings_match_in_process_onnx_runtime(service_triton, reference_session):
    result = await embeddings_create(texts=SENTENCES)
    assert result.vectors.shape == (len(SENTENCES), 384) and result.vectors.dtype == np.float32
    assert cosines(result.vectors, reference_vectors(reference_session, SENTENCES)).min() >= 0.9999
    assert np.allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)
    assert result.token_counts.tolist()[3:5] == [2, 2]  # empty and whitespace: [CLS] [SEP]


def test_sync_embeddings_match_async_ones(service_triton, reference_session):
    result = embeddings_create_sync(texts=SENTENCES)
    assert cosines(result.vectors, reference_vectors(reference_session, SENTENCES)).min() >= 0.9999


async def test_order_is_preserved_across_split_batches(service_triton, reference_session):
    # minilm takes at most 64 rows per call: 150 texts go out as 3 concurrent calls.
    texts = [f"sentence number {i} " + "word " * (i % 37) for i in range(150)]
    result = await embeddings_create(texts=texts)
    picked = [0, 63, 64, 127, 128, 149]
    expected = reference_vectors(reference_session, [texts[i] for i in picked])
    assert cosines(result.vectors[picked], expected).min() >= 0.9999
    # Neighbours differ, so a shuffled reassembly could not pass the check above by luck.
    assert cosines(result.vectors[:-1], result.vectors[1:]).max() < 0.9999


async def test_text_ensemble_gives_the_same_vectors_as_the_token_path(service_triton):
    tokens = await embeddings_create(texts=SENTENCES, model="minilm")
    text = await embeddings_create(texts=SENTENCES, model="minilm_text")
    assert cosines(tokens.vectors, text.vectors).min() >= 0.9999


async def test_hundred_thousand_characters_are_truncated(service_triton, reference_session):
    long_text = "lorem ipsum dolor sit amet " * 3800
    assert len(long_text) > 100_000
    result = await embeddings_create(texts=[long_text, "tail"])
    assert result.token_counts.tolist()[0] == 256
    assert cosines(result.vectors[:1], reference_vectors(reference_session, [long_text])).min() >= 0.9999


async def test_refusing_truncation_names_the_input(service_triton):
    with pytest.raises(InputTooLong) as caught:
        await embeddings_create(texts=["ok", "word " * 400], truncate=False)
    assert caught.value.index == 1


async def test_invalid_utf8_is_refused_before_triton(service_triton):
    with pytest.raises(InvalidText):
        await embeddings_create(texts=[b"\xff\xfe".decode("utf-8", "surrogateescape")])


async def test_a_model_triton_does_not_serve_is_not_loaded(service_triton):
    with pytest.raises(ModelNotLoaded, match="no_such_model") as raised:
        await embeddings_create(texts=["hello"], model="no_such_model")
    assert isinstance(raised.value.__cause__, TritonModelError)


async def test_triton_not_running_fails_fast_with_unavailable(settings):
    from embeddings.services.inference.clients import reset_clients

    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    settings.TRITON_TIMEOUT_S = 3.0
    reset_clients()
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(TritonUnavailable):
            await embeddings_create(texts=["hello"])
        assert asyncio.get_running_loop().time() - started < 3.5
    finally:
        reset_clients()


def test_triton_killed_mid_call_raises_within_the_deadline(tmp_path, settings):
    """A private Triton is SIGKILLed while a large request is in flight: a clear error, no hang."""
    import threading

    from embeddings.services.inference.clients import reset_clients

    server = start_triton(tmp_path, [Path(settings.TRITON_MODEL_REPOSITORY)], name="doomed")
    settings.TRITON_GRPC_TARGET = server.grpc_target
    settings.TRITON_TIMEOUT_S = 20.0
    reset_clients()
    killed_at: list[float] = []

    def kill() -> None:
        # When the kill starts: server.kill() also waits for the process to be gone, and the request
        # may fail meanwhile (a run saw it raise 0.1 s before kill() returned).
        killed_at.append(time.monotonic())
        server.kill()

    try:
        embeddings_create_sync(texts=["warm up"])
        killer = threading.Timer(0.3, kill)
        killer.start()
        with pytest.raises((TritonUnavailable, TritonTimeout)):
            embeddings_create_sync(texts=["a fairly long sentence to keep the model busy " * 20] * 1024)
        raised_at = time.monotonic()
        killer.join()
        assert killed_at and killed_at[0] < raised_at, "the request ended before Triton was killed"
        # Each RPC gives up within its deadline, TRITON_TIMEOUT_S after it was sent, retries
        # included: those in flight at the kill were sent before it, and any sent after it are
        # refused at once by a dead server. So the error comes within one deadline of the kill
        # however slow this machine is (on a quiet one, in well under a second).
        assert raised_at - killed_at[0] <= settings.TRITON_TIMEOUT_S, raised_at - killed_at[0]
    finally:
        server.stop(timeout_s=0)
        reset_clients()


def test_embed_command_prints_a_unit_384_vector(service_triton):
    out = io.StringIO()
    call_command("embed", "hello", stdout=out)
    line = orjson.loads(out.getvalue().splitlines()[0])
    assert line["dimensions"] == 384 and len(line["embedding"]) == 384
    assert abs(np.linalg.norm(np.array(line["embedding"])) - 1.0) < 1e-5


def test_embed_command_reports_errors_without_a_traceback(service_triton):
    with pytest.raises(CommandError, match=r"ModelNotLoaded: .*no_such_model"):
        call_command("embed", "hello", "--model", "no_such_model", stdout=io.StringIO())


async def test_dimensions_keep_the_first_n_renormalised(service_triton):
    full = await embeddings_create(texts=["hello world"])
    short = await embeddings_create(texts=["hello world"], dimensions=64)
    assert short.vectors.shape == (1, 64)
    assert abs(np.linalg.norm(short.vectors[0]) - 1.0) < 1e-5
    expected = full.vectors[0, :64] / np.linalg.norm(full.vectors[0, :64])
    assert np.allclose(short.vectors[0], expected, atol=1e-6)


async def test_dimensions_larger_than_the_model_are_refused(service_triton):
    with pytest.raises(InvalidRequest, match="larger"):
        await embedding.embeddings_create(
            target=MINILM, texts=["x"], options=EmbeddingOptions(dimensions=385)
        )


async def test_token_ids_give_the_same_vectors_as_text(service_triton):
    text = await embeddings_create(texts=["hello world"])
    ids = model_tokenizer("minilm").encode(["hello world"]).input_ids[0].tolist()
    tokens = await embedding.embeddings_create(target=MINILM, token_ids=[ids])
    assert cosines(text.vectors, tokens.vectors).min() >= 0.9999
    assert tokens.token_counts.tolist() == [len(ids)]


async def test_token_ids_outside_the_vocabulary_are_refused(service_triton):
    with pytest.raises(InvalidText, match="vocabulary"):
        await embedding.embeddings_create(target=MINILM, token_ids=[[101, 10**9, 102]])


async def test_empty_input_list_is_refused(service_triton):
    with pytest.raises(InvalidRequest):
        await embeddings_create(texts=[])


async def test_inflight_limit_refuses_at_once(service_triton, settings):
    settings.MAX_INFLIGHT_TRITON_CALLS = 2
    calls = [embeddings_create(texts=["a sentence to embed " * 30] * 64) for _ in range(6)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    served = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(served) == 2 and len(refused) == 4
    assert embedding.inflight_gate.in_flight == 0


# --- Token-bounded sub-batches and the request deadline ------------------------------------------

MIXED = [f"row {i} " + "word " * (3 + (i * 37) % 200) for i in range(40)]


@pytest.mark.parametrize("model", ["minilm", "minilm_text"])
async def test_sub_batched_requests_equal_the_reference_row_by_row(
    service_triton, reference_session, settings, model
):
    # 40 rows of 5..205 tokens in 512-token sub-batches: many sub-batches, rows reordered by
    # length and put back; each row must still be its own reference vector.
    settings.MAX_BATCH_TOKENS = 512
    settings.MAX_TOKENS_IN_FLIGHT = 1024
    result = await embeddings_create(texts=MIXED, model=model)
    groups = embedding._plan(
        await embedding.triton_async_client().model_metadata("minilm"),
        model_tokenizer("minilm").encode(MIXED),
    )
    assert len(groups) > 5
    assert cosines(result.vectors, reference_vectors(reference_session, MIXED)).min() >= 0.9999
    blocking = embedding.embeddings_create_sync(target=EmbeddingTarget(model), texts=MIXED)
    np.testing.assert_allclose(blocking.vectors, result.vectors, atol=1e-5)


async def test_token_id_rows_of_different_lengths_are_sub_batched_in_order(service_triton, settings):
    settings.MAX_BATCH_TOKENS = 256
    rows = [onnx_reference.token_ids(text) for text in MIXED]
    lengths = [len(ids) for ids in rows]
    spec = await embedding.triton_async_client().model_metadata("minilm")
    groups = embedding._plan(spec, model_tokenizer("minilm").encode_ids(rows))
    # Several sub-batches, some padding their shorter rows: where a wrong mask would show.
    assert len(groups) > 5 and any(len({lengths[row] for row in group.rows}) > 1 for group in groups)

    split = await embedding.embeddings_create(target=MINILM, token_ids=rows)
    blocking = embedding.embeddings_create_sync(target=MINILM, token_ids=rows)
    text = await embeddings_create(texts=MIXED)

    reference = onnx_reference.vectors_for_ids(rows)
    for vectors in (split.vectors, blocking.vectors, text.vectors):
        assert (cosines(vectors, reference) >= 0.9999).all()
    assert split.token_counts.tolist() == lengths


@pytest.mark.parametrize("direction", ["right", "left"])
@pytest.mark.parametrize("max_batch_tokens", [2048, 256])
async def test_token_ids_past_the_maximum_are_cut_at_their_own_end(
    service_triton, settings, direction, max_batch_tokens
):
    settings.MAX_BATCH_TOKENS = max_batch_tokens
    long = onnx_reference.token_ids(" ".join(f"w{i}" for i in range(300)) + " the very end")
    rows = [onnx_reference.token_ids("a short one"), long, onnx_reference.token_ids("word " * 60)]
    assert len(long) > 300

    result = await embedding.embeddings_create(
        target=MINILM, token_ids=rows, options=EmbeddingOptions(direction=direction)
    )

    kept = long[:256] if direction == "right" else long[-256:]
    reference = onnx_reference.vectors_for_ids([rows[0], kept, rows[2]])
    assert (cosines(result.vectors, reference) >= 0.9999).all()
    assert result.token_counts.tolist() == [len(rows[0]), 256, len(rows[2])]


async def test_a_request_past_its_deadline_ends_at_the_deadline(service_triton, settings):
    settings.MAX_BATCH_TOKENS = 512
    await embeddings_create(texts=["warm up"])
    started = asyncio.get_running_loop().time()
    with pytest.raises(InferenceTimeout, match="deadline"):
        await embedding.embeddings_create(
            target=MINILM, texts=["a long sentence to keep the model busy " * 40] * 128, timeout_s=0.5
        )
    elapsed = asyncio.get_running_loop().time() - started
    assert 0.5 <= elapsed < 1.5, elapsed
    assert embedding.inflight_gate.in_flight == 0
    from embeddings.services.inference.clients import inference_scheduler

    # Nothing of it waits any more, and the calls it had at Triton were cancelled with it.
    scheduler = inference_scheduler()
    assert scheduler.waiting_sub_batches == 0 and scheduler.in_flight == 0


async def test_chunked_inputs_are_their_chunks_run_alone_in_onnx_and_averaged(service_triton, settings):
    settings.CHUNK_OVERLAP_TOKENS = 16
    long_text = " ".join(f"river{i} bridge town" for i in range(300))
    ids = onnx_reference.token_ids(long_text)
    chunks = onnx_reference.chunks_of(ids, max_tokens=256, overlap=16)
    assert len(chunks) >= 4 and chunks[-1][-2] == ids[-2]
    expected = onnx_reference.chunks_aggregated(onnx_reference.vectors_for_ids(chunks), chunks)

    texts = ["short one", long_text, "another short one"]
    options = EmbeddingOptions(chunk=True)
    results = [
        await embedding.embeddings_create(target=MINILM, texts=texts, options=options),
        embedding.embeddings_create_sync(target=MINILM, texts=texts, options=options),
    ]
    shorts = onnx_reference.vectors_for_ids(
        [onnx_reference.token_ids(texts[0]), onnx_reference.token_ids(texts[2])]
    )
    for result in results:
        assert result.vectors.shape == (3, 384)
        assert onnx_reference.row_cosines(result.vectors[1:2], expected[None])[0] >= 0.99999
        assert onnx_reference.row_cosines(result.vectors[[0, 2]], shorts).min() >= 0.99999
        assert result.token_counts.tolist()[1] == sum(map(len, chunks))
        assert result.inputs == 3


async def test_a_model_that_tokenises_in_triton_cannot_chunk(service_triton):
    with pytest.raises(UnsupportedByModel, match="cannot embed long inputs in chunks"):
        await embeddings_create(texts=["hello"], model="minilm_text", chunk=True)
