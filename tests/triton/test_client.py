"""The Triton clients against a real Triton: readiness, metadata, split batches, faults.

Uses the test-only models in tests/triton_models: `instant_1024` (row i is filled with
input_ids[i, 0], element 1 counts attended tokens; max_batch_size 16) and `slow_echo`
(sleeps `sleep_ms`, then echoes `value`; creates the file `started_path` names as it starts;
stops sleeping once its caller gave up).

Bounds on elapsed time here are against hanging, never timings: each is derived from the
deadline under test with a margin for a busy machine, and the model's own work is made far
longer than deadline + margin, so a call that waited for the model cannot pass.
"""

import asyncio
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from embeddings.tooling.triton_server import free_port
from embeddings.triton import (
    PRIORITY_BULK,
    PRIORITY_INTERACTIVE,
    AsyncTritonClient,
    ModelStatistics,
    TritonClient,
    TritonInvalidInput,
    TritonModelError,
    TritonTimeout,
    TritonUnavailable,
)
from tests.conftest import TEST_MODEL_REPOSITORY, start_triton
from tests.triton.statistics import STATISTICS_SETTLE_S, settled

INSTANT = "instant_1024"
# What a loaded two-core machine may add to a deadline before the caller sees the error.
MARGIN_S = 5.0
# slow_echo's sleep in the deadline tests: far beyond any deadline + MARGIN_S used with it.
SLOW_CALL_MS = 60_000
# How long to wait for an event (a call inside the model, a queue filled) before failing.
HANG_DEADLINE_S = 30


def token_batch(rows: int, length: int = 9, attended: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Row i starts with token 1000 + i; the last `length - attended` positions are padding."""
    input_ids = np.tile(np.arange(length, dtype=np.int64), (rows, 1))
    input_ids[:, 0] = 1000 + np.arange(rows)
    attention_mask = np.zeros_like(input_ids)
    attention_mask[:, :attended] = 1
    return input_ids, attention_mask


def slow_inputs(sleep_ms: int, *, started: Path | None = None) -> dict[str, np.ndarray]:
    inputs = {"sleep_ms": np.array([sleep_ms], dtype=np.int64), "value": np.ones((1, 2), np.float32)}
    if started is not None:
        inputs["started_path"] = np.array([str(started).encode()], dtype=object)
    return inputs


async def until(condition, what: str) -> None:
    """Poll `condition` until it holds; fail after HANG_DEADLINE_S (a bound on hanging)."""
    deadline = time.monotonic() + HANG_DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {HANG_DEADLINE_S} s: {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
def client(triton_server):
    with TritonClient(triton_server.grpc_target, timeout_s=10) as client:
        yield client


async def test_readiness_and_metadata(triton_server):
    async with AsyncTritonClient(triton_server.grpc_target, timeout_s=10) as client:
        assert await client.server_live() is True
        assert await client.server_ready() is True
        assert await client.model_ready(INSTANT) is True
        assert await client.model_ready("no_such_model") is False

        spec = await client.model_metadata(INSTANT)
        assert [(t.name, t.datatype, t.shape) for t in spec.inputs] == [
            ("input_ids", "INT64", (-1, -1)),
            ("attention_mask", "INT64", (-1, -1)),
        ]
        assert [(t.name, t.datatype, t.shape) for t in spec.outputs] == [("embedding", "FP32", (-1, 1024))]
        assert (spec.name, spec.version, spec.max_batch_size) == (INSTANT, "1", 16)
        assert await client.model_metadata(INSTANT) is spec  # read once, then cached


def assert_rows_in_order(embeddings: np.ndarray, input_ids: np.ndarray, attended: int) -> None:
    assert embeddings.shape == (len(input_ids), 1024)
    assert embeddings.dtype == np.float32
    np.testing.assert_array_equal(embeddings[:, 0], input_ids[:, 0])
    np.testing.assert_array_equal(embeddings[:, 1], attended)
    np.testing.assert_array_equal(embeddings[:, 2:], np.repeat(input_ids[:, :1], 1022, axis=1))


# Read until `calls` more succeeded (tests/triton/statistics.py says why); the test then asserts
# the exact count.


async def statistics_after(client: AsyncTritonClient, before: ModelStatistics, calls: int) -> ModelStatistics:
    deadline = time.monotonic() + STATISTICS_SETTLE_S
    while True:
        after = await client.model_statistics(INSTANT)
        if after.success_count - before.success_count >= calls or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.05)


def statistics_after_sync(client: TritonClient, before: ModelStatistics, calls: int) -> ModelStatistics:
    return settled(
        lambda: client.model_statistics(INSTANT),
        lambda after: after.success_count - before.success_count >= calls,
    )


async def test_async_request_over_max_batch_size_is_split_and_reassembled_in_order(triton_server):
    input_ids, attention_mask = token_batch(100)
    async with AsyncTritonClient(triton_server.grpc_target, channels=3, timeout_s=10) as client:
        before = await client.model_statistics(INSTANT)
        embeddings = await client.embed_tokens(INSTANT, input_ids, attention_mask)
        after = await statistics_after(client, before, calls=7)

    assert_rows_in_order(embeddings, input_ids, attended=6)
    assert after.success_count - before.success_count == 7  # ceil(100 / 16) ModelInfer calls
    assert after.inference_count - before.inference_count == 100


def test_sync_request_over_max_batch_size_is_split_and_reassembled_in_order(client):
    input_ids, attention_mask = token_batch(100, length=4, attended=3)
    before = client.model_statistics(INSTANT)
    embeddings = client.embed_tokens(INSTANT, input_ids.astype(np.int32), attention_mask)
    after = statistics_after_sync(client, before, calls=7)

    assert_rows_in_order(embeddings, input_ids, attended=3)
    assert after.success_count - before.success_count == 7
    assert after.inference_count - before.inference_count == 100
    np.testing.assert_array_equal(
        client.infer(INSTANT, {"input_ids": input_ids, "attention_mask": attention_mask}), embeddings
    )


async def test_concurrent_requests_of_different_lengths_each_get_their_own_rows(triton_server):
    async with AsyncTritonClient(triton_server.grpc_target, timeout_s=10) as client:
        batches = [token_batch(rows, length=rows + 2, attended=rows + 1) for rows in range(1, 21)]
        results = await asyncio.gather(*(client.embed_tokens(INSTANT, ids, mask) for ids, mask in batches))
    for (ids, _), embeddings in zip(batches, results, strict=True):
        assert_rows_in_order(embeddings, ids, attended=len(ids) + 1)


async def test_unknown_model_is_a_model_error(triton_server):
    async with AsyncTritonClient(triton_server.grpc_target, timeout_s=10) as client:
        with pytest.raises(TritonModelError, match=r"'no_such_model' failed with NOT_FOUND") as raised:
            await client.embed_texts("no_such_model", ["hello"])
    assert isinstance(raised.value.__cause__, grpc.RpcError)
    assert raised.value.target == triton_server.grpc_target


def test_unknown_model_is_a_model_error_sync(client):
    with pytest.raises(TritonModelError, match="NOT_FOUND"):
        client.embed_tokens("no_such_model", *token_batch(2))


def test_wrong_input_is_invalid_input(client):
    input_ids, attention_mask = token_batch(2)
    with pytest.raises(TritonInvalidInput, match=r"INVALID_ARGUMENT: unexpected inference input 'token_ids'"):
        client.infer(INSTANT, {"token_ids": input_ids, "attention_mask": attention_mask})
    with pytest.raises(TritonInvalidInput, match="missing required input"):
        client.infer(INSTANT, {"input_ids": input_ids})
    with pytest.raises(TritonInvalidInput, match="first \\(batch\\) dimension"):
        client.infer(INSTANT, {"input_ids": input_ids, "attention_mask": attention_mask[:1]})
    with pytest.raises(TritonModelError, match="single BYTES text input"):
        client.embed_texts(INSTANT, ["this model takes token ids"])


async def test_triton_not_running_is_unavailable_within_the_deadline():
    """Refused connections are retried (with backoff) only within the call's deadline."""
    target = f"127.0.0.1:{free_port()}"  # nobody listens here
    timeout_s = 2.0
    async with AsyncTritonClient(target, timeout_s=timeout_s, retries=3) as client:
        started = time.monotonic()
        with pytest.raises(
            TritonUnavailable, match=f"Triton at {target}: ServerReady failed with UNAVAILABLE"
        ):
            await client.server_ready()
        assert time.monotonic() - started < timeout_s + MARGIN_S
    with TritonClient(target, timeout_s=timeout_s, retries=3) as sync_client:
        started = time.monotonic()
        with pytest.raises(TritonUnavailable, match="after 4 attempts"):
            sync_client.embed_tokens(INSTANT, *token_batch(2))
        assert time.monotonic() - started < timeout_s + MARGIN_S


async def test_deadline_shorter_than_the_call_is_a_timeout(triton_server):
    """A 0.5 s deadline against a call the model answers after 60 s: a timeout, at the deadline."""
    timeout_s = 0.5
    async with AsyncTritonClient(triton_server.grpc_target, timeout_s=timeout_s) as client:
        await client.model_metadata("slow_echo")  # not part of the timed call
        started = time.monotonic()
        with pytest.raises(TritonTimeout, match="DEADLINE_EXCEEDED"):
            await client.infer("slow_echo", slow_inputs(SLOW_CALL_MS))
        assert time.monotonic() - started < timeout_s + MARGIN_S
    with TritonClient(triton_server.grpc_target, timeout_s=timeout_s) as client:
        client.model_metadata("slow_echo")
        started = time.monotonic()
        with pytest.raises(TritonTimeout):
            client.infer("slow_echo", slow_inputs(SLOW_CALL_MS))
        assert time.monotonic() - started < timeout_s + MARGIN_S
    # The calls given up were cancelled at Triton too: the model's instances are free again.
    with TritonClient(triton_server.grpc_target, timeout_s=HANG_DEADLINE_S) as client:
        np.testing.assert_array_equal(client.infer("slow_echo", slow_inputs(sleep_ms=10)), [[1.0, 1.0]])


async def test_a_call_s_own_timeout_replaces_the_client_deadline(triton_server):
    """The client's deadline (120 s) is far longer than the model's 60 s; the call's own 0.3 s wins."""
    call_timeout_s = 0.3
    async with AsyncTritonClient(triton_server.grpc_target, timeout_s=120) as client:
        await client.model_metadata("slow_echo")
        started = time.monotonic()
        with pytest.raises(TritonTimeout):
            await client.infer("slow_echo", slow_inputs(SLOW_CALL_MS), timeout_s=call_timeout_s)
        assert time.monotonic() - started < call_timeout_s + MARGIN_S
    with TritonClient(triton_server.grpc_target, timeout_s=120) as client:
        client.model_metadata("slow_echo")
        started = time.monotonic()
        with pytest.raises(TritonTimeout):
            client.infer("slow_echo", slow_inputs(SLOW_CALL_MS), timeout_s=call_timeout_s)
        assert time.monotonic() - started < call_timeout_s + MARGIN_S


def pending_requests(triton_server, model: str) -> float:
    """Requests Triton holds in `model`'s queue, not yet executing (its metrics endpoint)."""
    url = f"http://{triton_server.address}:{triton_server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:  # loopback: the test's own Triton
        text = response.read().decode()
    prefix = f'nv_inference_pending_request_count{{model="{model}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def test_bulk_work_queued_at_triton_yields_to_a_small_request(triton_server):
    """minilm's config sets priority levels: with both model instances busy and more bulk rows
    queued than one batch holds (max_batch_size 64), a small request sent last goes into the next
    batch, ahead of bulk work queued before it. Without the levels it would wait for a second batch."""
    rng = np.random.default_rng(7)

    def batch(rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        ids = rng.integers(1000, 20000, size=(rows, length))
        return ids, np.ones_like(ids)

    async with AsyncTritonClient(triton_server.grpc_target, timeout_s=120) as client:
        await client.embed_tokens("minilm", *batch(1, 8))
        finished: list[str] = []

        async def call(name: str, priority: int, rows: int, length: int) -> None:
            await client.embed_tokens("minilm", *batch(rows, length), priority=priority)
            finished.append(name)

        # Both instances busy; the second far longer, so the next batch forms on the first alone.
        running = [asyncio.ensure_future(call("busy-long", PRIORITY_BULK, 32, 256))]
        # Each busy call in a batch of its own: sent 50 ms apart, 25 times minilm's batching window
        # (max_queue_delay 2 ms). If they were merged anyway, one instance would stay free and take
        # the queued calls, and the wait for the queue below fails, saying so.
        await asyncio.sleep(0.05)
        running.append(asyncio.ensure_future(call("busy-short", PRIORITY_BULK, 8, 256)))
        await asyncio.sleep(0.05)
        # 80 rows queued: the next batch can take 64 of them.
        queued = [asyncio.ensure_future(call(f"queued{i}", PRIORITY_BULK, 8, 32)) for i in range(10)]
        # The small request is sent once Triton holds more bulk rows waiting than one batch takes
        # (9 of the 8-row calls), which also shows that both instances are busy.
        await until(
            lambda: pending_requests(triton_server, "minilm") >= 9 or any(task.done() for task in queued),
            "80 bulk rows waiting at Triton",
        )
        assert not any(task.done() for task in queued), "an instance was free: the busy calls merged"
        await call("small", PRIORITY_INTERACTIVE, 1, 10)
        await asyncio.gather(*running, *queued)
    bulk_after_small = len(finished) - 1 - finished.index("small")
    assert bulk_after_small >= 3, finished


async def test_triton_killed_mid_call_fails_fast_with_a_clear_error(tmp_path):
    """SIGKILL Triton while an async and a sync call wait on a slow model: both end with
    TritonUnavailable (connection lost, reconnects refused) long before their deadline."""
    # The stubs busy in slow_echo outlive SIGTERM once tritonserver is gone: kill() SIGKILLs them
    # after this grace period, which the test need not wait out for the default 15 s.
    server = start_triton(tmp_path, [TEST_MODEL_REPOSITORY], name="triton-killed", stop_timeout_s=2)
    timeout_s = 40.0
    # "Long before the deadline": within half of it, which leaves 20 s for a busy machine to
    # notice the lost connection; the model would answer only after the deadline.
    fails_within_s = timeout_s / 2
    try:
        async_client = AsyncTritonClient(server.grpc_target, timeout_s=timeout_s, retries=3)
        sync_client = TritonClient(server.grpc_target, timeout_s=timeout_s, retries=3)
        await async_client.model_metadata("slow_echo")
        sync_client.model_metadata("slow_echo")
        sleep_ms = int(timeout_s * 2 * 1000)
        sync_started, async_started = tmp_path / "sync-started", tmp_path / "async-started"

        sync_outcome: list[BaseException] = []

        def sync_call() -> None:
            try:
                sync_client.infer("slow_echo", slow_inputs(sleep_ms, started=sync_started))
            except BaseException as error:  # handed over to the test's thread
                sync_outcome.append(error)

        sync_thread = threading.Thread(target=sync_call)
        sync_thread.start()
        async_call = asyncio.ensure_future(
            async_client.infer("slow_echo", slow_inputs(sleep_ms, started=async_started))
        )
        # Both calls are inside the model's execute() (each on one of its two instances).
        await until(lambda: sync_started.exists() and async_started.exists(), "both calls in the model")
        assert not async_call.done() and sync_thread.is_alive()

        server.kill()
        killed = time.monotonic()
        with pytest.raises(TritonUnavailable, match=f"Triton at {server.grpc_target}: ModelInfer"):
            await asyncio.wait_for(async_call, timeout=fails_within_s)
        await asyncio.to_thread(sync_thread.join, fails_within_s)
        assert not sync_thread.is_alive()
        assert len(sync_outcome) == 1 and isinstance(sync_outcome[0], TritonUnavailable), sync_outcome
        assert time.monotonic() - killed < fails_within_s

        # Later calls keep failing the same clear way, and quickly.
        with pytest.raises(TritonUnavailable):
            await async_client.server_live()
        await async_client.close()
        sync_client.close()
    finally:
        server.stop(timeout_s=0)


async def test_texts_reach_a_bytes_model_byte_for_byte(triton_server):
    texts = [
        "",
        "   ",
        "héllo wörld 🙂",
        b"\xff\xfe not utf-8",
        "x" * 100_000,
        *(f"text {i}" for i in range(15)),
    ]
    expected = [
        [len(raw), raw[0] if raw else -1] for raw in (t.encode() if isinstance(t, str) else t for t in texts)
    ]
    async with AsyncTritonClient(triton_server.grpc_target, timeout_s=10) as client:
        embeddings = await client.embed_texts("bytes_length", texts)  # 20 texts: 3 calls of at most 8
    np.testing.assert_array_equal(embeddings, np.array(expected, np.float32))
    with TritonClient(triton_server.grpc_target, timeout_s=10) as client:
        np.testing.assert_array_equal(client.embed_texts("bytes_length", texts), embeddings)
