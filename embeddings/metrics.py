"""Our Prometheus metrics: requests, inputs and tokens, where the time goes, in-flight calls and
tokens, batches, queue time, Triton errors, the job backlog, what the HTTP edge refused, the
embedding cache (rows found, its Redis's time and failures, evictions; its Redis's own figures).

Exported at /metrics by django-prometheus's view. With PROMETHEUS_MULTIPROC_DIR set (runstack sets
it for its uvicorn workers before they start), prometheus_client keeps every value in a per-process
file there and /metrics sums them across the workers; without it (tests, `manage.py` commands) the
values live in this process. Label values are bounded: endpoint names, catalog model names, HTTP
statuses and exception class names, never anything a client types.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from embeddings.triton.errors import TritonError

# Seconds, from a cache-warm tokenisation of one short text up to a large batch near its deadline.
DURATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

REQUESTS = Counter(
    "embedsite_requests",
    "API requests answered, by endpoint, model (empty when none was resolved) and HTTP status.",
    ["endpoint", "model", "status"],
)
INPUTS = Counter("embedsite_inputs", "Inputs embedded, by endpoint and model.", ["endpoint", "model"])
TOKENS = Counter("embedsite_tokens", "Tokens embedded, by endpoint and model.", ["endpoint", "model"])
TOKENIZATION_SECONDS = Histogram(
    "embedsite_tokenization_seconds",
    "Time to tokenise one request's inputs, by Triton model.",
    ["model"],
    buckets=DURATION_BUCKETS,
)
# The embedding cache (services/inference/vector_cache.py): where each looked-up row was found.
EMBEDDING_CACHE_ROWS = Counter(
    "embedsite_embedding_cache_rows",
    "Rows looked up in the embedding cache, by result: local (this process's entries), redis, miss.",
    ["result"],
)
EMBEDDING_CACHE_SECONDS = Histogram(
    "embedsite_embedding_cache_seconds",
    "Time of one embedding-cache Redis operation (a request's lookup or its write of the misses).",
    ["operation"],
    buckets=DURATION_BUCKETS,
)
EMBEDDING_CACHE_FAILURES = Counter(
    "embedsite_embedding_cache_failures",
    "Embedding-cache Redis operations that failed or timed out (the rows were computed as without it).",
    ["operation"],
)
EMBEDDING_CACHE_EVICTIONS = Counter(
    "embedsite_embedding_cache_evictions",
    "Entries the embedding cache evicted to stay within its bound, by where: local (this process's LRU).",
    ["where"],
)
EMBEDDING_CACHE_LOCAL_EVICTIONS = EMBEDDING_CACHE_EVICTIONS.labels("local")
# Every label value from the start, so rate() and the dashboard see them at 0 before the first use.
for _result in ("local", "redis", "miss"):
    EMBEDDING_CACHE_ROWS.labels(_result)
for _operation in ("lookup", "write"):
    EMBEDDING_CACHE_SECONDS.labels(_operation)
    EMBEDDING_CACHE_FAILURES.labels(_operation)
TRITON_CALL_SECONDS = Histogram(
    "embedsite_triton_call_seconds",
    "Time of one request's Triton inference (all its batches), by Triton model.",
    ["model"],
    buckets=DURATION_BUCKETS,
)
# Per Triton call formed (merged or not): how well concurrent requests are batched.
BATCH_ROWS = Histogram(
    "embedsite_batch_rows",
    "Rows in one Triton inference call formed by this process, by Triton model.",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
BATCH_TOKENS = Histogram(
    "embedsite_batch_tokens",
    "Padded tokens in one Triton inference call formed by this process, by Triton model.",
    ["model"],
    buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
SERIALIZATION_SECONDS = Histogram(
    "embedsite_serialization_seconds",
    "Time to render one response body as JSON, by endpoint.",
    ["endpoint"],
    buckets=DURATION_BUCKETS,
)
# livesum: the sum over live worker processes; a worker that stops drops out (see `lifespan`).
TRITON_IN_FLIGHT = Gauge(
    "embedsite_triton_in_flight",
    "Inference calls in flight to Triton, summed over the server's worker processes.",
    multiprocess_mode="livesum",
)
# Request latency as the client sees it, from arrival at Django to the rendered response (the p99
# alert in deploy/prometheus reads it).
REQUEST_SECONDS = Histogram(
    "embedsite_request_seconds",
    "Time to answer one API request, from its arrival to its rendered response, by endpoint.",
    ["endpoint"],
    buckets=DURATION_BUCKETS,
)
# The seed's queue time: how long a sub-batch waited for its turn (the fair scheduler's room and,
# merged, for the call it left in) before it was sent to Triton.
QUEUE_SECONDS = Histogram(
    "embedsite_queue_seconds",
    "Time one sub-batch waited in this process before it was sent to Triton, by Triton model.",
    ["model"],
    buckets=DURATION_BUCKETS,
)
TOKENS_IN_FLIGHT = Gauge(
    "embedsite_tokens_in_flight",
    "Padded tokens of sub-batches at Triton (granted by the fair scheduler), summed over workers.",
    multiprocess_mode="livesum",
)
# Set from the database when /metrics is scraped (embeddings/api/metrics_export.py): the most
# recent reading of any worker process is the one reported.
JOBS_ACTIVE = Gauge(
    "embedsite_jobs_active",
    "Jobs not yet finished, by status (queued, running, cancelling).",
    ["status"],
    multiprocess_mode="mostrecent",
)
JOB_INPUTS_PENDING = Gauge(
    "embedsite_job_inputs_pending",
    "Inputs of unfinished jobs not yet embedded (the job backlog).",
    multiprocess_mode="mostrecent",
)
JOB_OLDEST_ACTIVE_SECONDS = Gauge(
    "embedsite_job_oldest_active_seconds",
    "Age of the oldest unfinished job (0 when none).",
    multiprocess_mode="mostrecent",
)
# The HTTP edge (embedsite/edge.py) and admission (embeddings/api/admission.py): what they refused
# or closed, by a bounded reason (head_too_large, head_timeout, too_many_connections, queue_full, ...).
HTTP_EDGE_REFUSED = Counter(
    "embedsite_http_edge_refused",
    "Requests refused or connections closed before the application, by reason.",
    ["reason"],
)
ADMISSION_WAITING = Gauge(
    "embedsite_admission_waiting",
    "API requests waiting for a slot to run (admission), summed over the server's worker processes.",
    multiprocess_mode="livesum",
)
ADMISSION_WAIT_SECONDS = Histogram(
    "embedsite_admission_wait_seconds",
    "Time an API request that had to wait for a slot waited before it ran.",
    buckets=DURATION_BUCKETS,
)
TRITON_ERRORS = Counter(
    "embedsite_triton_errors",
    "Failed Triton calls, by Triton model and error kind (TritonUnavailable, TritonTimeout, ...).",
    ["model", "kind"],
)


def request_observed(*, endpoint: str, model: str, status: int, seconds: float | None = None) -> None:
    REQUESTS.labels(endpoint, model, str(status)).inc()
    if seconds is not None:
        REQUEST_SECONDS.labels(endpoint).observe(seconds)


def embedded_observed(*, endpoint: str, model: str, inputs: int, tokens: int) -> None:
    INPUTS.labels(endpoint, model).inc(inputs)
    TOKENS.labels(endpoint, model).inc(tokens)


# Error kinds whose counters exist from a model's first call (at 0), so rate() and the alerts in
# deploy/prometheus see them before the first failure.
TRITON_ERROR_KINDS = ("TritonUnavailable", "TritonTimeout", "TritonModelNotLoaded", "TritonModelError")
_errors_initialised: set[str] = set()


@contextmanager
def triton_call_observed(model: str) -> Iterator[None]:
    """Times a successful Triton call; counts a failed one by its exception class."""
    if model not in _errors_initialised:
        _errors_initialised.add(model)
        for kind in TRITON_ERROR_KINDS:
            TRITON_ERRORS.labels(model, kind)
    started = time.perf_counter()
    try:
        yield
    except TritonError as error:
        TRITON_ERRORS.labels(model, type(error).__name__).inc()
        raise
    TRITON_CALL_SECONDS.labels(model).observe(time.perf_counter() - started)


class EmbeddingCacheRedisFigures:
    """The embedding cache's Redis, as its INFO said at this scrape (None: it did not answer).

    Read when /metrics is scraped (embeddings/api/metrics_export.py), never stored: they are the
    server's own figures, the same from every process and pod (the dashboard takes their max, never
    their sum), and a Redis that stops answering shows as `up` 0 with no stale memory figures.
    `generate_latest` asks an object like this one only for collect().
    """

    def __init__(self, info: Mapping[str, object] | None) -> None:
        self.info = info

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "embedsite_embedding_cache_redis_up",
            "1 if the embedding cache's Redis answered INFO within EMBEDDING_CACHE_TIMEOUT_S at this scrape.",
            value=0 if self.info is None else 1,
        )
        if self.info is None:
            return
        yield CounterMetricFamily(
            "embedsite_embedding_cache_redis_evicted_keys",
            "Keys the embedding cache's Redis evicted to stay within maxmemory (INFO evicted_keys; "
            "from 0 again when it restarts).",
            value=float(self.info["evicted_keys"]),
        )
        yield GaugeMetricFamily(
            "embedsite_embedding_cache_redis_memory_used_bytes",
            "Memory the embedding cache's Redis uses (INFO used_memory).",
            value=float(self.info["used_memory"]),
        )
        yield GaugeMetricFamily(
            "embedsite_embedding_cache_redis_memory_max_bytes",
            "The embedding cache's Redis maxmemory (0: unbounded).",
            value=float(self.info["maxmemory"]),
        )


async def lifespan(scope, receive, send) -> None:
    """ASGI lifespan: a stopping worker removes its live-gauge file so `livesum` no longer counts it."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                multiprocess.mark_process_dead(os.getpid())
            await send({"type": "lifespan.shutdown.complete"})
            return
