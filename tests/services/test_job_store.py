"""The job store on a real Redis of its own: chunks in and out, counted once, streamed, cancelled, deleted."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from embeddings.redis.connections import redis_job_store
from embeddings.result_dtypes import ResultOutOfRange
from embeddings.services.jobs.store import JOB_EVENTS_KEPT, JobProgress, JobStore

DIMS = 4


@pytest.fixture
def store(service_redis) -> JobStore:
    return JobStore(redis_job_store(), "job_abc123", ttl_s=600)


def vectors(rows: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(rows * DIMS, dtype=np.float32) + start).reshape(rows, DIMS)


def test_inputs_round_trip_with_ids(store):
    chunks = [["a", "b"], ["c"]]
    assert store.put_inputs(chunks, ids=[["id-1", "id-2"], ["id-3"]]) == 2
    assert store.chunk_inputs(0) == ["a", "b"]
    assert store.chunk_inputs(1) == ["c"]
    assert store.chunk_ids(1) == ["id-3"]
    assert store.chunk_inputs(2) is None
    assert 590 < redis_job_store().ttl(store.key("in", 0)) <= 600


def test_a_chunk_is_finished_and_counted_once(store):
    assert store.finish_chunk(0, vectors(2), tokens=7) is True
    # A redelivered chunk (other numbers, as if recomputed) changes nothing.
    assert store.finish_chunk(0, vectors(2, start=100), tokens=7) is False
    assert store.fail_chunk(0, rows=2) is False
    np.testing.assert_array_equal(store.chunk_result(0, DIMS), vectors(2))
    assert store.progress() == JobProgress(completed=2, failed=0, tokens=7, chunks_done=1)
    assert store.is_chunk_done(0) and not store.is_chunk_done(1)


def test_failed_chunks_are_counted_without_results(store):
    assert store.fail_chunk(3, rows=5) is True
    assert store.chunk_result(3, DIMS) is None
    assert store.progress() == JobProgress(failed=5, chunks_done=1)


def test_a_failed_chunk_keeps_its_error_beside_its_count(store):
    assert store.fail_chunk(2, rows=5, error="embedding_failed: the model\nanswered 1024-d vectors") is True
    assert store.finish_chunk(0, vectors(2), tokens=7) is True
    # Counted once: a second failure (a redelivery, a give-up) leaves the first error.
    assert store.fail_chunk(2, rows=5, error="model_unavailable: later") is False
    assert store.fail_chunk(0, rows=2, error="too late: chunk 0 was written") is False
    assert store.failed_chunks() == {2}
    assert store.chunk_errors() == {2: "embedding_failed: the model answered 1024-d vectors"}
    assert 590 < redis_job_store().ttl(store.key("errors")) <= 600
    assert 590 < redis_job_store().ttl(store.key("failed")) <= 600
    store.fail_chunk(4, rows=1, error="x" * 1000)
    assert len(store.chunk_errors()[4]) == 300 and store.chunk_errors()[4].endswith("…")
    store.delete(5)
    assert store.failed_chunks() == set() and store.chunk_errors() == {}


def test_a_job_keeps_its_latest_events_oldest_first(store):
    store.event_append("running")
    for number in range(JOB_EVENTS_KEPT + 5):
        store.event_append("chunk_failed", f"chunk {number}: embedding_failed: wrong\nanswer")
    events = store.events()
    assert len(events) == JOB_EVENTS_KEPT
    # The oldest six went: the running event and chunks 0-4's failures.
    assert [event.detail for event in events[:2]] == [
        "chunk 5: embedding_failed: wrong answer",
        "chunk 6: embedding_failed: wrong answer",
    ]
    assert events[-1].event == "chunk_failed" and events[-1].detail.startswith("chunk 54:")
    assert all(abs(event.at_ms / 1000 - time.time()) < 60 for event in events)
    assert 590 < redis_job_store().ttl(store.key("events")) <= 600
    store.delete(1)
    assert store.events() == []


def test_concurrent_finishers_count_once(store):
    results: list[bool] = []

    def finish() -> None:
        results.append(store.finish_chunk(1, vectors(3), tokens=9))

    threads = [threading.Thread(target=finish) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(True) == 1
    assert store.progress() == JobProgress(completed=3, tokens=9, chunks_done=1)


def test_results_read_back_per_chunk_and_little_endian(store):
    store.finish_chunk(1, vectors(1, start=50), tokens=1)
    store.finish_chunk(0, vectors(2), tokens=2)
    read = [store.chunk_result(chunk, DIMS) for chunk in range(3)]
    np.testing.assert_array_equal(read[0], vectors(2))
    np.testing.assert_array_equal(read[1], vectors(1, start=50))
    assert read[2] is None
    raw = redis_job_store().get(store.key("out", 0))
    assert raw == vectors(2).astype("<f4").tobytes()


def test_cancel_and_delete(store):
    store.put_inputs([["a"], ["b"]])
    store.finish_chunk(0, vectors(1), tokens=1)
    assert not store.is_cancelled()
    store.cancel()
    assert store.is_cancelled()
    store.delete(2)
    assert redis_job_store().keys("job:{job_abc123}:*") == []
    assert store.progress() == JobProgress()


def test_jobs_do_not_share_keys(service_redis):
    first = JobStore(redis_job_store(), "job_one", ttl_s=60)
    second = JobStore(redis_job_store(), "job_two", ttl_s=60)
    first.finish_chunk(0, vectors(1), tokens=1)
    assert second.progress() == JobProgress()
    assert not second.is_chunk_done(0)


def test_usage_is_kept_with_the_chunk_once_until_forgotten(store):
    usage = {"1|2|3600|jobs|tokens|minilm": 7, "1|2|3600|jobs|requests|minilm": 1}
    assert store.finish_chunk(0, vectors(2), tokens=7, usage=usage) is True
    # A redelivered chunk (its usage measured again, other latency) keeps the first run's.
    assert (
        store.finish_chunk(0, vectors(2), tokens=7, usage={**usage, "1|2|3600|jobs|tokens|minilm": 9})
        is False
    )
    assert store.fail_chunk(1, rows=3, usage={"1|2|3600|jobs|failed|minilm": 1}) is True
    assert store.finish_chunk(2, vectors(1), tokens=1) is True  # no usage: nothing kept
    assert store.uncounted_usage(0) == {0: usage}
    assert store.uncounted_usage() == {0: usage, 1: {"1|2|3600|jobs|failed|minilm": 1}}
    store.forget_usage([0])
    assert store.uncounted_usage(0) == {} and list(store.uncounted_usage()) == [1]
    assert 590 < redis_job_store().ttl(store.key("uncounted")) <= 600


def test_usage_counts_once_per_chunk_in_the_critical_redis(store):
    from embeddings.redis.connections import redis_sync
    from embeddings.services.quotas.usage import LIVE_USAGE_KEY, usage_count_once

    usage = {"1|2|3600|jobs|tokens|minilm": 7, "1|2|3600|jobs|requests|minilm": 1}
    offered = [usage_count_once(owner=store.job_id, unit=0, increments=usage, ttl_s=600) for _ in range(3)]
    assert offered == [True, False, False]
    assert usage_count_once(owner=store.job_id, unit=5, increments=usage, ttl_s=600) is True
    # Another job's chunk 0 is another unit.
    assert usage_count_once(owner="job_other", unit=0, increments=usage, ttl_s=600) is True
    counted = {field.decode(): int(amount) for field, amount in redis_sync().hgetall(LIVE_USAGE_KEY).items()}
    assert counted == {field: 3 * amount for field, amount in usage.items()}
    # Counters and markers are in the critical Redis only; the job store holds job data.
    assert not redis_job_store().exists(LIVE_USAGE_KEY)
    assert 590 < redis_sync().ttl(f"usage:counted:{{{store.job_id}}}") <= 600


def test_concurrent_offers_of_one_chunk_count_once(store):
    from embeddings.redis.connections import redis_sync
    from embeddings.services.quotas.usage import LIVE_USAGE_KEY, usage_count_once

    results: list[bool] = []

    def offer() -> None:
        results.append(usage_count_once(owner=store.job_id, unit=7, increments={"f": 2}, ttl_s=60))

    threads = [threading.Thread(target=offer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(True) == 1
    assert redis_sync().hget(LIVE_USAGE_KEY, "f") == b"2"


def test_a_float16_store_keeps_half_the_bytes_and_reads_float32(service_redis):
    half = JobStore(redis_job_store(), "job_half", ttl_s=60, result_dtype="float16")
    written = vectors(3) / 7  # values float16 rounds
    assert half.finish_chunk(0, written, tokens=3) is True
    raw = redis_job_store().get(half.key("out", 0))
    assert raw == written.astype("<f2").tobytes() and len(raw) == 3 * DIMS * 2
    read = half.chunk_result(0, DIMS)
    assert read.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(read, written.astype(np.float16).astype(np.float32))
    # A value float16 cannot hold is refused before anything is written or counted.
    with pytest.raises(ResultOutOfRange):
        half.finish_chunk(1, vectors(1) * 1e5, tokens=1)
    assert not half.is_chunk_done(1) and redis_job_store().exists(half.key("out", 1)) == 0
    assert half.progress() == JobProgress(completed=3, tokens=3, chunks_done=1)
