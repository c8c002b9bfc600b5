"""The Redis package: packing, the key layout, and one operation run alike by every transport."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio

from embeddings.redis import keys, operations, scripts
from embeddings.redis.connections import LeanScriptClient, pack_command, redis_lean_async, redis_sync
from embeddings.redis.transport import (
    Command,
    PackedRun,
    ScriptCall,
    _packed,
    operation_run,
    operation_run_sync,
    single,
)


@pytest.mark.unit
def test_packed_commands_are_what_redis_py_sends():
    arguments = ["EVALSHA", "ab" * 20, 2, PackedRun.of(["k1", b"k\r\n2"]), -7, 1.5, "é", PackedRun.of([3])]
    flat = ["EVALSHA", "ab" * 20, 2, "k1", b"k\r\n2", -7, 1.5, "é", 3]
    expected = b"".join(redis.connection.Connection().pack_command(*flat))
    assert _packed(arguments) == expected


@pytest.mark.unit
def test_a_jobs_keys_share_its_hash_tag_and_cover_every_kind():
    names = keys.job_keys("job_abc", 2)
    assert len(names) == len(set(names)) == len(keys.JOB_KINDS) + 2 * len(keys.CHUNK_KINDS)
    assert all(name.startswith("job:{job_abc}:") for name in names)
    assert keys.job_chunk_key("job_abc", "out", 1) in names
    with pytest.raises(ValueError):
        keys.job_key("job_abc", "settled")  # the marker lives in the critical Redis, not here
    scope = keys.quota_scope(tenant_id=4, key_id=9, level="key")
    assert keys.quota_counter(scope, window="rpm", start=60) == "quota:{t4}:k9:rpm:60"
    assert keys.quota_leases(keys.quota_scope(tenant_id=4, key_id=None, level="tenant")) == (
        "quota:{t4}:t:concurrent"
    )


@pytest.mark.unit
def test_every_script_has_its_own_name_and_sha():
    defined = [value for value in vars(scripts).values() if isinstance(value, scripts.Script)]
    assert len({script.name for script in defined}) == len(defined) > 10
    assert len({script.sha for script in defined}) == len(defined)


def _count_twice(owner: str):
    """One operation of a script and a pipelined pair of plain commands."""
    first = yield from operations.usage_count_once(owner=owner, unit=3, increments={"f": 2}, ttl_s=60)
    again = yield from operations.usage_count_once(owner=owner, unit=3, increments={"f": 2}, ttl_s=60)
    live, bit = yield [
        Command.of("HGET", keys.LIVE_USAGE, "f"),
        Command.of("GETBIT", keys.usage_counted(owner), 3),
    ]
    return first, again, int(live), bit


async def test_one_operation_runs_alike_on_every_transport_and_reloads_flushed_scripts(service_redis):
    client = redis_sync()
    assert redis_lean_async() is not None  # plain TCP: the lean client
    redis_py = redis.asyncio.Redis.from_url(service_redis.url)
    try:
        client.script_flush()  # as after a Redis restart: each transport must load it again
        results = [operation_run_sync(_count_twice("sync"), client)]
        client.script_flush()
        results.append(await operation_run(_count_twice("lean")))
        client.script_flush()
        results.append(await operation_run(_count_twice("redis-py"), client=redis_py))
    finally:
        await redis_py.aclose()
    assert results == [(True, False, 2, 1), (True, False, 4, 1), (True, False, 6, 1)]


async def test_an_error_reply_in_a_pipeline_leaves_the_lean_connection_in_step(service_redis):
    redis_sync().set("a-string", "x")
    with pytest.raises(redis.exceptions.ResponseError):
        await operation_run(single([Command.of("HGET", "a-string", "f"), Command.of("GET", "a-string")]))
    assert await operation_run(single(Command.of("GET", "a-string"))) == b"x"
    assert await operation_run(single([Command.of("GET", "a-string")])) == [b"x"]  # a batch of one
    assert operation_run_sync(single([Command.of("GET", "a-string")]), redis_sync()) == [b"x"]
    call = ScriptCall(scripts.QUOTA_SETTLE, [keys.LIVE_USAGE], [0, "", 0, 1, "g", 5])
    assert await operation_run(single(call)) == 1
    assert redis_sync().hget(keys.LIVE_USAGE, "g") == b"5"


# --- The lean client's one pipelined connection ----------------------------------------------------


@pytest.fixture
async def connects(monkeypatch) -> list[int]:
    """The connections the lean client opens from now on."""
    opened: list[int] = []
    lean = redis_lean_async()
    lean.close()
    connect = lean._connect

    async def counted():
        opened.append(1)
        return await connect()

    monkeypatch.setattr(lean, "_connect", counted)
    return opened


async def test_concurrent_commands_share_one_connection_and_each_gets_its_reply(service_redis, connects):
    replies = await asyncio.gather(
        *(operation_run(single(Command.of("INCRBY", "counted", n))) for n in range(1, 101))
    )
    # Each INCRBY's reply is the counter after it: sorted, they rise by the increments in order.
    assert sorted(replies)[-1] == sum(range(1, 101)) and len(set(replies)) == 100
    scripts_and_batches = await asyncio.gather(
        operation_run(single([Command.of("GET", "counted"), Command.of("SET", "other", "x")])),
        operation_run(single(ScriptCall(scripts.QUOTA_SETTLE, [keys.LIVE_USAGE], [0, "", 0, 1, "h", 2]))),
        operation_run(single(Command.of("GET", "other"))),
    )
    assert scripts_and_batches == [[str(sum(range(1, 101))).encode(), b"OK"], 1, b"x"]
    assert connects == [1]


async def test_an_error_reply_is_its_commands_alone(service_redis, connects):
    redis_sync().set("a-string", "x")
    outcomes = await asyncio.gather(
        operation_run(single(Command.of("GET", "a-string"))),
        operation_run(single(Command.of("HGET", "a-string", "f"))),
        operation_run(single(Command.of("GET", "a-string"))),
        return_exceptions=True,
    )
    assert outcomes[0] == outcomes[2] == b"x"
    assert isinstance(outcomes[1], redis.exceptions.ResponseError)
    assert connects == [1]


async def test_a_caller_that_gives_up_leaves_the_connection_in_step(service_redis, settings, connects):
    """Cancelled, or past REDIS_TIMEOUT_S: its reply, when it comes, is read and dropped, and the
    next command gets its own."""
    redis_sync().set("a-string", "x")
    blocked = asyncio.ensure_future(operation_run(single(Command.of("BLPOP", "empty-list", "0.3"))))
    await asyncio.sleep(0.05)
    blocked.cancel()
    assert await operation_run(single(Command.of("GET", "a-string"))) == b"x"

    redis_lean_async().timeout = 0.1
    with pytest.raises(redis.exceptions.TimeoutError):
        await operation_run(single(Command.of("BLPOP", "empty-list", "0.3")))
    redis_lean_async().timeout = settings.REDIS_TIMEOUT_S
    assert await operation_run(single(Command.of("GET", "a-string"))) == b"x"
    assert connects == [1]


async def test_the_lean_client_selects_the_database_its_url_names(service_redis):
    url = f"{service_redis.url.rsplit('/', 1)[0]}/3"
    client = LeanScriptClient(url)
    try:
        assert await client.call(pack_command("SET", "in-db-3", "x")) == b"OK"
    finally:
        client.close()
    database_3 = redis.Redis.from_url(url)
    try:
        assert database_3.get("in-db-3") == b"x"
        assert redis_sync().get("in-db-3") is None
    finally:
        # Left behind, it fails test_quotas' check of the same database's size when a worker runs
        # that file after this one.
        database_3.delete("in-db-3")
