"""The two Redis roles as `runstack` runs them: a full job store leaves quotas and the broker working,
and the critical Redis keeps unfolded usage across a crash (append-only file), folded once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.db.models import Sum

from embeddings.callers import Caller
from embeddings.errors.service import JobStoreUnavailable, QuotaExceeded
from embeddings.models import EmbeddingJob, UsageBucket
from embeddings.redis.connections import redis_job_store, redis_sync, reset_redis_clients
from embeddings.services.accounts.tenants import tenant_create
from embeddings.services.inference.catalog import embedding_model_register_local
from embeddings.services.jobs.store import JobStore
from embeddings.services.jobs.submission import JobSpec, job_create
from embeddings.services.quotas.limits import (
    QuotaLimitValues,
    quota_release_sync,
    quota_reserve,
    quota_reserve_sync,
    quota_status_sync,
)
from embeddings.services.quotas.usage import (
    LIVE_USAGE_KEY,
    UsageEvent,
    usage_count_once,
    usage_fold,
)
from embeddings.tooling.local_redis import RedisServer, local_redis_servers
from embeddings.tooling.triton_server import free_port

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = 1_767_225_600  # 2026-01-01 00:00 UTC
# Small enough to fill in a moment; the critical Redis's is left as runstack sets it.
JOB_STORE_MAXMEMORY_MB = 8
CHUNK_BYTES = 1024 * 1024
# A job larger than what a full job store has left, whatever Redis's own buffers take (Redis
# counts a request's arguments against maxmemory while it runs, so a small write may still fit).
BIG_JOB_TEXTS = ["y" * 64 * 1024] * 64
FILLER_KEYS = b"job:{job_filler_"


def point_service_at(settings, critical_url: str, job_store_url: str) -> None:
    """The service's clients, the broker and the channel layer on these servers (as service_redis does)."""
    settings.REDIS_URL = settings.CELERY_BROKER_URL = critical_url
    settings.JOB_STORE_URL = job_store_url
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [critical_url], "prefix": "test:channels:"},
        }
    }
    reset_redis_clients()


@pytest.fixture
def local_stores(tmp_path: Path, settings) -> Iterator[dict[str, RedisServer]]:
    """The critical Redis and the job store that `runstack` starts (local_redis_servers), on free
    ports with their data in tmp_path, and the service pointed at them."""
    settings.RUN_DIR = tmp_path
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.RUNSTACK_JOB_STORE_MAXMEMORY_MB = JOB_STORE_MAXMEMORY_MB
    servers = local_redis_servers()
    assert set(servers) == {"critical", "job store"}
    try:
        for server in servers.values():
            server.start()
            server.wait_until_ready()
        point_service_at(settings, servers["critical"].url, servers["job store"].url)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        reset_redis_clients()


def config(server: RedisServer) -> dict[str, str]:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    return {
        name: client.config_get(name)[name]
        for name in ("maxmemory", "maxmemory-policy", "appendonly", "appendfsync")
    }


def test_runstack_runs_both_roles_bounded_without_eviction_and_with_an_append_only_file(
    local_stores, settings
):
    mib = 1024 * 1024
    assert config(local_stores["critical"]) == {
        "maxmemory": str(settings.RUNSTACK_REDIS_MAXMEMORY_MB * mib),
        "maxmemory-policy": "noeviction",
        "appendonly": "yes",
        "appendfsync": "everysec",
    }
    assert config(local_stores["job store"]) == {
        "maxmemory": str(JOB_STORE_MAXMEMORY_MB * mib),
        "maxmemory-policy": "noeviction",
        "appendonly": "yes",
        "appendfsync": "everysec",
    }
    # Without JOB_STORE_URL (or naming the same port) one server holds both roles and both budgets.
    settings.JOB_STORE_URL = ""
    (shared,) = local_redis_servers().values()
    assert shared.port == local_stores["critical"].port
    assert shared.maxmemory_mb == settings.RUNSTACK_REDIS_MAXMEMORY_MB + JOB_STORE_MAXMEMORY_MB
    settings.JOB_STORE_URL = "redis://redis.example.internal:6379/0"
    with pytest.raises(Exception, match="not ours to start"):
        local_redis_servers()


def test_runstack_gives_the_embedding_cache_an_evicting_server_of_its_own(tmp_path, settings):
    settings.RUN_DIR = tmp_path
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.EMBEDDING_CACHE_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.RUNSTACK_EMBEDDING_CACHE_MAXMEMORY_MB = 8
    assert set(local_redis_servers()) == {"critical", "job store"}  # the cache off: not started
    settings.EMBEDDING_CACHE = True
    with local_redis_servers()["embedding cache"] as cache:
        assert config(cache) == {
            "maxmemory": str(8 * 1024 * 1024),
            "maxmemory-policy": "allkeys-lfu",
            "appendonly": "no",
            "appendfsync": "everysec",
        }
    # On the job store's port (or the critical one's) it is that server's: nothing more is started.
    settings.EMBEDDING_CACHE_REDIS_URL = settings.JOB_STORE_URL.replace("/0", "/3")
    assert set(local_redis_servers()) == {"critical", "job store"}


def fill_job_store(client: redis.Redis, maxmemory_mb: int) -> int:
    """Store 1 MiB chunks until the job store refuses one (maxmemory, noeviction); the bytes stored.
    Every key it writes starts with FILLER_KEYS."""
    stored = 0
    for number in range(maxmemory_mb * 4):  # a bound against a server that never refuses
        try:
            JobStore(client, f"job_filler_{number}", ttl_s=600).put_inputs([["x" * CHUNK_BYTES]])
            stored += CHUNK_BYTES
        except JobStoreUnavailable as refused:
            assert "full" in str(refused)
            return stored
    pytest.fail(f"the job store took {stored} bytes with maxmemory {maxmemory_mb} MiB")


def job_keys_besides_the_filler(client: redis.Redis) -> list[bytes]:
    return [key for key in client.scan_iter("job:*") if not key.startswith(FILLER_KEYS)]


def broker_round_trip(url: str) -> dict:
    """A message through Celery's broker connection (the Redis transport workers consume from)."""
    from embedsite.celery import app

    with app.connection_for_write(url) as connection:
        queue = connection.SimpleQueue("test-stores")
        try:
            queue.put({"job": 1, "chunk": 2})
            message = queue.get(timeout=10)
            message.ack()
            return message.payload
        finally:
            queue.close()


def test_a_full_job_store_leaves_quota_checks_and_the_broker_unaffected(local_stores, settings):
    tenant = tenant_create(name="Alpha")
    tenant.requests_per_minute, tenant.request_burst, tenant.tokens_per_day = 2, 2, 1_000_000
    tenant.save()
    model = embedding_model_register_local(repository=Path(settings.TRITON_MODEL_REPOSITORY))
    stored = fill_job_store(redis_job_store(), JOB_STORE_MAXMEMORY_MB)
    # Refused near its maxmemory, not long before (Redis's own use and the request's buffers take
    # the rest).
    assert JOB_STORE_MAXMEMORY_MB * CHUNK_BYTES // 2 <= stored <= JOB_STORE_MAXMEMORY_MB * CHUNK_BYTES
    # A job submitted now is refused whole: no row, no data, its reserved tokens given back.
    with pytest.raises(JobStoreUnavailable):
        job_create(tenant_id=tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=BIG_JOB_TEXTS))
    assert EmbeddingJob.objects.count() == 0
    assert job_keys_besides_the_filler(redis_job_store()) == []
    assert quota_status_sync(tenant.pk)["tenant"]["tokens_per_day"]["used"] == 0
    # The request path's quota check (async, lean client) and the workers' (sync) still count and
    # still refuse, in a minute of their own (two ahead: the submission's request is not in it).
    caller = Caller(tenant.pk, None, QuotaLimitValues.of(tenant))
    later = time.time() + 120
    asyncio.run(quota_reserve(caller=caller, inputs=1, tokens=5, now=later))
    quota_reserve_sync(caller=caller, inputs=1, tokens=5, now=later)
    with pytest.raises(QuotaExceeded):
        quota_reserve_sync(caller=caller, inputs=1, tokens=5, now=later)
    assert usage_count_once(owner="job_x", unit=0, increments={"f": 1}, ttl_s=60) is True
    assert broker_round_trip(settings.CELERY_BROKER_URL) == {"job": 1, "chunk": 2}


def test_a_job_store_that_does_not_answer_refuses_a_job_whole(local_stores, settings):
    tenant = tenant_create(name="Alpha")
    tenant.tokens_per_day = 1_000_000
    tenant.save()
    model = embedding_model_register_local(repository=Path(settings.TRITON_MODEL_REPOSITORY))
    settings.JOB_STORE_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    reset_redis_clients()
    with pytest.raises(JobStoreUnavailable, match="does not answer"):
        job_create(tenant_id=tenant.pk, api_key_id=None, spec=JobSpec(model=model, texts=["a", "b"]))
    assert EmbeddingJob.objects.count() == 0
    assert quota_status_sync(tenant.pk)["tenant"]["tokens_per_day"]["used"] == 0


def wait_until_written(server: RedisServer) -> None:
    """Until Redis has written its append-only buffer to the file (it fsyncs every second; a killed
    process loses nothing the kernel holds, only a machine crash would lose that last second)."""
    client = redis.Redis.from_url(server.url)
    deadline = time.monotonic() + 30  # against a hang only
    while client.info("persistence")["aof_buffer_length"] > 0:
        assert time.monotonic() < deadline, "Redis never wrote its append-only buffer"
        time.sleep(0.05)


def crash_and_restart(server: RedisServer) -> RedisServer:
    server.kill()
    again = RedisServer(
        port=server.port,
        data_dir=server.data_dir,
        persistent=server.persistent,
        log_path=server.log_path,
        maxmemory_mb=server.maxmemory_mb,
    )
    again.start()
    again.wait_until_ready()
    reset_redis_clients()  # the old connections died with the server
    return again


def record_usage(tenant_id: int) -> None:
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(tenant_id, None, "minilm", "openai", "succeeded", 2, 10, 5, HOUR),
    )
    job_chunk = {
        f"{tenant_id}||{HOUR}|jobs|{metric}|minilm": amount
        for metric, amount in (("requests", 1), ("inputs", 5), ("tokens", 40))
    }
    assert usage_count_once(owner="job_restart", unit=3, increments=job_chunk, ttl_s=600)


def test_a_crash_of_the_critical_redis_keeps_unfolded_usage_folded_once(local_stores, settings, tmp_path):
    tenant = tenant_create(name="Alpha")
    record_usage(tenant.pk)
    recorded = redis_sync().hgetall(LIVE_USAGE_KEY)
    assert len(recorded) == 8  # five counters of the request, three of the job chunk
    wait_until_written(local_stores["critical"])
    local_stores["critical"] = crash_and_restart(local_stores["critical"])
    assert redis_sync().hgetall(LIVE_USAGE_KEY) == recorded
    # The chunk's marker survived too: its redelivery after the restart does not count it again.
    assert usage_count_once(owner="job_restart", unit=3, increments={"anything": 1}, ttl_s=600) is False
    for _ in range(2):  # a second fold finds nothing more to add
        usage_fold()
        totals = UsageBucket.objects.filter(tenant_id=tenant.pk).aggregate(
            requests=Sum("requests"), inputs=Sum("inputs"), tokens=Sum("tokens")
        )
        assert totals == {"requests": 2, "inputs": 7, "tokens": 50}
    assert not redis_sync().exists(LIVE_USAGE_KEY)

    # The control: the same crash of a Redis without the append-only file loses the counters.
    volatile = RedisServer(port=free_port(), data_dir=tmp_path / "volatile", persistent=False)
    volatile.start()
    try:
        volatile.wait_until_ready()
        point_service_at(settings, volatile.url, local_stores["job store"].url)
        record_usage(tenant.pk)
        assert redis_sync().exists(LIVE_USAGE_KEY)
        volatile = crash_and_restart(volatile)
        assert not redis_sync().exists(LIVE_USAGE_KEY)
    finally:
        volatile.stop()
