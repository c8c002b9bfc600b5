"""A job's inputs and results in the job store (JOB_STORE_URL): chunked, kept for the job's TTL,
written once, read as a stream.

The job's keys, their types and lifetimes are in embeddings.redis.keys (`job:{<id>}:...`: the hash
tag keeps one job's keys on one Redis Cluster slot); JobStore names them only through that module, runs
its script through the package's operations, and `delete` removes every one of them (keys.job_keys).

A chunk's result, its entry in `done`, the progress counters and its usage increments (in
`uncounted`) are written by one script, so a chunk that runs twice (a worker killed after writing,
Celery redelivering) neither writes twice nor counts twice. The usage counters themselves live in
the critical Redis, another server: no script spans both, so the increments wait in `uncounted`
until they are counted there, once per chunk (a marker per chunk beside the counters), and are
forgotten only after that: a worker dying in between leaves them to the chunk's redelivery, the
watchdog or the job's end (embeddings.services.jobs.engine), never lost and never counted twice.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import numpy as np
import orjson
import redis
from django.conf import settings
from django.utils import timezone

from embeddings.errors.service import JobStoreUnavailable
from embeddings.redis import keys, operations
from embeddings.redis.connections import redis_job_store
from embeddings.redis.transport import operation_run_sync
from embeddings.result_dtypes import (
    DEFAULT_RESULT_DTYPE,
    result_decode,
    result_encode,
    result_returned_dtype,
    result_row_width,
    result_storage_name,
)

if TYPE_CHECKING:
    from embeddings.models import EmbeddingJob


@dataclass(frozen=True)
class EncodedInputs:
    """A job's inputs as they will be stored: one payload per chunk (and its ids'), so their
    bytes are known exactly before anything is written (embeddings.services.jobs.budget)."""

    texts: list[bytes]
    ids: list[bytes] | None = None

    @property
    def text_bytes(self) -> int:
        return sum(map(len, self.texts))

    @property
    def id_bytes(self) -> int:
        return sum(map(len, self.ids or ()))


def inputs_encode(
    chunks: Sequence[Sequence[str]], ids: Sequence[Sequence[str]] | None = None
) -> EncodedInputs:
    """Each chunk's texts (and ids) as the orjson lists put_inputs stores."""
    return EncodedInputs(
        texts=[orjson.dumps(list(texts)) for texts in chunks],
        ids=None if ids is None else [orjson.dumps(list(chunk_ids)) for chunk_ids in ids],
    )


# A chunk's error as kept for operators: enough to say what failed, bounded so that a job of many
# failed chunks holds little more than its bookkeeping allowance (budget.py).
CHUNK_ERROR_MAX_CHARS = 300


def error_text(error: str) -> str:
    """`error` as a chunk's error is kept: one line, at most CHUNK_ERROR_MAX_CHARS."""
    line = " ".join(error.split())
    return line if len(line) <= CHUNK_ERROR_MAX_CHARS else line[: CHUNK_ERROR_MAX_CHARS - 1] + "…"


# Events a job keeps (state changes, chunk failures, re-sends, operators' actions), its latest:
# a short history for the admin, bounded whatever the job's size (a few KiB at most).
JOB_EVENTS_KEPT = 50


@dataclass(frozen=True)
class JobEvent:
    """One event in a job's history: when (unix ms), what (a status, or what happened), details."""

    at_ms: int
    event: str
    detail: str = ""


@dataclass(frozen=True)
class RetryRound:
    """An operator's retry of a failed job's failed chunks: the tokens it reserved (on `counters`,
    the critical Redis's token budget counters) and the job's token counts when it began, so that
    its end refunds what the round did not use, once (engine.py _settle)."""

    reserved: int
    tokens_before: int
    cached_before: int
    counters: list[str]


@dataclass(frozen=True)
class JobProgress:
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    chunks_done: int = 0
    # Of tokens, those the embedding cache answered.
    cached_tokens: int = 0


class JobStore:
    """One job's data in Redis (blocking client: Celery workers and the download views' threads)."""

    def __init__(
        self, client: redis.Redis, job_id: str, *, ttl_s: int, result_dtype: str = DEFAULT_RESULT_DTYPE
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.ttl_s = int(ttl_s)
        self.result_dtype = result_dtype

    def key(self, kind: str, chunk: int | None = None) -> str:
        """One of the job's keys (embeddings.redis.keys): a chunk's with `chunk`."""
        if chunk is None:
            return keys.job_key(self.job_id, kind)
        return keys.job_chunk_key(self.job_id, kind, chunk)

    # --- inputs (submission) ----------------------------------------------------------------

    def put_inputs(self, chunks: Sequence[Sequence[str]], ids: Sequence[Sequence[str]] | None = None) -> int:
        """Store every chunk's texts (and ids); returns the number of chunks."""
        return self.put_encoded_inputs(inputs_encode(chunks, ids))

    def put_encoded_inputs(self, inputs: EncodedInputs) -> int:
        """Store every chunk's encoded texts (and ids); returns the number of chunks. Raises
        JobStoreUnavailable when the job store refuses them (full: noeviction) or cannot be reached;
        the caller deletes what got in."""
        pipeline = self.client.pipeline(transaction=False)
        for number, texts in enumerate(inputs.texts):
            pipeline.set(self.key("in", number), texts, ex=self.ttl_s)
            if inputs.ids is not None:
                pipeline.set(self.key("ids", number), inputs.ids[number], ex=self.ttl_s)
        try:
            pipeline.execute()
        except redis.exceptions.RedisError as error:
            if isinstance(error, redis.exceptions.OutOfMemoryError):
                raise JobStoreUnavailable(
                    "The job store is full, so the job was not submitted; retry later."
                ) from error
            raise JobStoreUnavailable(
                "The job store does not answer, so the job was not submitted; retry shortly."
            ) from error
        return len(inputs.texts)

    def delete_inputs(self, chunks: Iterable[int]) -> None:
        """Remove these chunks' texts once they will not run again (the ids stay: results name
        them)."""
        names = [self.key("in", chunk) for chunk in chunks]
        for start in range(0, len(names), 1000):
            self.client.delete(*names[start : start + 1000])

    def inputs_kept(self, chunks: Iterable[int]) -> int:
        """How many of these chunks still have their texts."""
        pipeline = self.client.pipeline(transaction=False)
        for chunk in chunks:
            pipeline.exists(self.key("in", chunk))
        return sum(pipeline.execute())

    def input_bytes(self, chunks: Iterable[int]) -> int:
        """The stored bytes of these chunks' texts (0 for a chunk whose texts are gone)."""
        pipeline = self.client.pipeline(transaction=False)
        for chunk in chunks:
            pipeline.strlen(self.key("in", chunk))
        return sum(pipeline.execute())

    def put_reservation(self, counter_keys: Sequence[str]) -> None:
        """Remember which quota counters (in the critical Redis) the job's tokens were reserved on,
        to refund its unused tokens at the end."""
        try:
            self.client.set(self.key("reservation"), orjson.dumps(list(counter_keys)), ex=self.ttl_s)
        except redis.exceptions.RedisError as error:
            raise JobStoreUnavailable("The job store cannot take the job now; retry later.") from error

    def reservation(self) -> list[str]:
        raw = self.client.get(self.key("reservation"))
        return orjson.loads(raw) if raw else []

    def retry_round_save(self, number: int, retry: RetryRound) -> None:
        self.client.hset(self.key("retry"), number, orjson.dumps(dataclasses.asdict(retry)))
        self.client.expire(self.key("retry"), self.ttl_s)

    def retry_round_drop(self, number: int) -> None:
        """Forget a round that did not start (it reserved nothing that is still held)."""
        self.client.hdel(self.key("retry"), number)

    def retry_rounds(self) -> dict[int, RetryRound]:
        """The job's retry rounds by number (1, 2, ...), in order."""
        raw = self.client.hgetall(self.key("retry"))
        return {
            int(number): RetryRound(**orjson.loads(value))
            for number, value in sorted(raw.items(), key=lambda item: int(item[0]))
        }

    def chunk_inputs(self, chunk: int) -> list[str] | None:
        """The chunk's texts; None once they are gone (expired or deleted)."""
        raw = self.client.get(self.key("in", chunk))
        return None if raw is None else orjson.loads(raw)

    def chunk_ids(self, chunk: int) -> list[str] | None:
        raw = self.client.get(self.key("ids", chunk))
        return None if raw is None else orjson.loads(raw)

    # --- results (workers) --------------------------------------------------------------------

    def is_chunk_done(self, chunk: int) -> bool:
        return bool(self.client.sismember(self.key("done"), chunk))

    def finish_chunk(
        self,
        chunk: int,
        vectors: np.ndarray,
        *,
        tokens: int,
        cached_tokens: int = 0,
        usage: dict[str, int] | None = None,
    ) -> bool:
        """Write a chunk's vectors (in the job's result dtype) and count them and their tokens (of
        which `cached_tokens` the embedding cache answered), and keep its usage increments to be
        counted, once; False if the chunk was already finished. Raises ResultOutOfRange, before
        anything is written, for a value the result dtype cannot hold."""
        payload = result_encode(vectors, self.result_dtype)
        return self._finish(
            chunk,
            payload,
            rows=len(vectors),
            tokens=tokens,
            cached_tokens=cached_tokens,
            counter="completed",
            usage=usage,
        )

    def finish_chunk_lines(
        self,
        chunk: int,
        lines: bytes,
        *,
        rows: int,
        tokens: int,
        cached_tokens: int = 0,
        usage: dict[str, int] | None = None,
    ) -> bool:
        """Write a batch chunk's output lines (JSONL bytes) and count `rows` of them completed, once,
        as finish_chunk does for vectors; False if the chunk was already finished."""
        return self._finish(
            chunk,
            lines,
            rows=rows,
            tokens=tokens,
            cached_tokens=cached_tokens,
            counter="completed",
            usage=usage,
        )

    def chunk_lines(self, chunk: int) -> bytes | None:
        """A finished batch chunk's output lines; None if it has none (failed, expired)."""
        raw = self.client.get(self.key("out", chunk))
        return raw or None

    def fail_chunk(
        self, chunk: int, *, rows: int, usage: dict[str, int] | None = None, error: str = ""
    ) -> bool:
        """Count a chunk's inputs as failed (and keep its usage increments), and record it failed
        with `error`, once; False if the chunk was already finished."""
        return self._finish(
            chunk, b"", rows=rows, tokens=0, counter="failed", usage=usage, error=error_text(error)
        )

    def failed_chunks(self) -> set[int]:
        """The chunks counted failed."""
        return {int(chunk) for chunk in self.client.smembers(self.key("failed"))}

    def chunk_errors(self) -> dict[int, str]:
        """Each chunk's last error: why it failed, or why it was last retried."""
        return {
            int(chunk): error.decode(errors="replace")
            for chunk, error in self.client.hgetall(self.key("errors")).items()
        }

    def _finish(
        self,
        chunk: int,
        payload: bytes,
        *,
        rows: int,
        tokens: int,
        counter: str,
        usage: dict[str, int] | None,
        cached_tokens: int = 0,
        error: str = "",
    ) -> bool:
        finish = operations.job_chunk_finish(
            job_id=self.job_id,
            chunk=chunk,
            payload=payload,
            ttl_s=self.ttl_s,
            rows=rows,
            tokens=tokens,
            counter=counter,
            increments=orjson.dumps(usage) if usage else b"",
            cached_tokens=cached_tokens,
            error=error,
        )
        return operation_run_sync(finish, self.client)

    def uncounted_usage(self, chunk: int | None = None) -> dict[int, dict[str, int]]:
        """Usage increments of finished chunks not yet counted (one chunk's, or all of them)."""
        if chunk is not None:
            raw = self.client.hget(self.key("uncounted"), chunk)
            return {} if raw is None else {chunk: orjson.loads(raw)}
        return {
            int(number): orjson.loads(raw)
            for number, raw in self.client.hgetall(self.key("uncounted")).items()
        }

    def forget_usage(self, chunks: Sequence[int]) -> None:
        """Drop increments the critical Redis has counted."""
        if chunks:
            self.client.hdel(self.key("uncounted"), *chunks)

    def progress(self) -> JobProgress:
        values = self.client.hgetall(self.key("progress"))
        return JobProgress(**{name.decode(): int(count) for name, count in values.items()})

    # --- cancel, read back, delete ------------------------------------------------------------

    def cancel(self) -> None:
        self.client.set(self.key("cancel"), 1, ex=self.ttl_s)

    def is_cancelled(self) -> bool:
        return bool(self.client.exists(self.key("cancel")))

    def event_append(self, event: str, detail: str = "") -> None:
        """Add an event to the job's history (the latest JOB_EVENTS_KEPT are kept)."""
        record = {"at": round(time.time() * 1000), "event": event, "detail": error_text(detail)}
        pipeline = self.client.pipeline(transaction=False)
        pipeline.rpush(self.key("events"), orjson.dumps(record))
        pipeline.ltrim(self.key("events"), -JOB_EVENTS_KEPT, -1)
        pipeline.expire(self.key("events"), self.ttl_s)
        pipeline.execute()

    def events(self) -> list[JobEvent]:
        """The job's kept events, oldest first."""
        records = [orjson.loads(raw) for raw in self.client.lrange(self.key("events"), 0, -1)]
        return [JobEvent(record["at"], record["event"], record.get("detail", "")) for record in records]

    def event_due(self, interval_s: float) -> bool:
        """True at most once every `interval_s` (progress events' rate limit, across workers)."""
        return bool(self.client.set(self.key("event"), 1, nx=True, px=int(interval_s * 1000)))

    def result_layout(self, dims: int) -> tuple[np.dtype, int]:
        """(dtype, values a row) of what chunk_result returns for `dims`-dimensional vectors:
        float32 x dims for float results (float32 or float16 stored), the quantised type's own
        dtype x dims (int8, uint8) or x dims / 8 (binary, ubinary)."""
        return result_returned_dtype(self.result_dtype), result_row_width(self.result_dtype, dims)

    def chunk_result(self, chunk: int, dims: int) -> np.ndarray | None:
        """A finished chunk's vectors (rows x dims float32 whatever the result dtype, or for a
        quantised output type as stored: result_layout); None if it has none (failed, expired)."""
        raw = self.client.get(self.key("out", chunk))
        return None if raw is None else result_decode(raw, self.result_dtype, dims)

    def extend(self, chunks: int, ttl_s: int) -> None:
        """Make every key of the job live at least `ttl_s` from now (never shorter than it does)."""
        operation_run_sync(operations.job_extend(self.job_id, chunks, ttl_s), self.client)
        self.ttl_s = max(self.ttl_s, ttl_s)

    def ttls(self, chunks: int) -> dict[str, int]:
        """Each existing key of the job and the seconds it has left (for operators and tests)."""
        names = keys.job_keys(self.job_id, chunks)
        pipeline = self.client.pipeline(transaction=False)
        for name in names:
            pipeline.ttl(name)
        return {name: ttl for name, ttl in zip(names, pipeline.execute(), strict=True) if ttl != -2}

    def delete(self, chunks: int) -> None:
        """Remove every key of the job in the job store (inputs, ids, results, counters, the
        engine's and the leases'): keys.job_keys lists them all."""
        operation_run_sync(operations.job_delete(self.job_id, chunks), self.client)


# A job's keys outlive its expires_at by this much: the expiry sweep deletes them first, and a key
# written late (a redelivered chunk) cannot vanish before the job it belongs to.
STORE_GRACE_S = 86400


def job_store_ttl_s(expires_at: datetime | None) -> int:
    """What a job's keys are written to live: JOB_RESULT_TTL_S and a day, or a day past expires_at
    where an operator moved it later (operator.py job_extend_expiry), so that no write shortens
    the life an extension gave the job's data."""
    ttl_s = settings.JOB_RESULT_TTL_S
    if expires_at is not None:
        ttl_s = max(ttl_s, math.ceil((expires_at - timezone.now()).total_seconds()))
    return ttl_s + STORE_GRACE_S


def job_store(job: EmbeddingJob) -> JobStore:
    """The job's data in the job store; kept a day past expires_at at most (expiry deletes it first)."""
    return JobStore(
        redis_job_store(),
        job.public_id,
        ttl_s=job_store_ttl_s(job.expires_at),
        result_dtype=result_storage_name(result_dtype=job.result_dtype, output_type=job.output_type),
    )


def chunk_rows(job: EmbeddingJob) -> list[int]:
    """How many inputs each of the job's chunks holds (the last may hold fewer)."""
    return [min(job.chunk_size, job.total - chunk * job.chunk_size) for chunk in range(job.chunks)]
