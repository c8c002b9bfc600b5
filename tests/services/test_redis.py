"""The local Redis launcher and the service's Redis clients: real redis-server, timeouts when it is gone."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from embeddings.services.local_redis import RedisServer
from embeddings.services.redis_clients import redis_async, redis_sync, reset_redis_clients
from embeddings.triton.server import free_port


def test_sync_client_talks_to_the_test_redis(service_redis):
    client = redis_sync()
    client.set("greeting", "hello")
    assert client.get("greeting") == b"hello"
    assert client is redis_sync()


async def test_async_client_is_per_event_loop(service_redis):
    client = redis_async()
    await client.set("answer", 42)
    assert await client.get("answer") == b"42"
    assert redis_async() is client


def test_a_stopped_redis_fails_fast(tmp_path, settings):
    with RedisServer(port=free_port(), data_dir=tmp_path, persistent=False) as server:
        settings.REDIS_URL = server.url
        settings.REDIS_TIMEOUT_S = 0.5
        reset_redis_clients()
        assert redis_sync().ping()
    assert not server.is_ready()
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis_sync().ping()

    async def ping_async() -> None:
        await redis_async().ping()

    with pytest.raises(redis.exceptions.ConnectionError):
        asyncio.run(ping_async())
    assert time.monotonic() - started < 5
    reset_redis_clients()


def test_persistent_server_keeps_data_across_restarts(tmp_path):
    port = free_port()
    with RedisServer(port=port, data_dir=tmp_path) as server:
        redis.Redis.from_url(server.url).set("kept", "yes")
    with RedisServer(port=port, data_dir=tmp_path) as server:
        assert redis.Redis.from_url(server.url).get("kept") == b"yes"
