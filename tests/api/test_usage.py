"""GET /v1/usage over the real ASGI app: own tenant only, grouping, totals, unfolded counters,
validation, quota state."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db.models import Sum

from embeddings.models import UsageBucket
from embeddings.redis.connections import reset_redis_clients
from embeddings.services.accounts.api_keys import api_key_create
from embeddings.services.quotas import usage
from embeddings.services.quotas.limits import quota_release
from embeddings.services.quotas.usage import UsageEvent, usage_fold
from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import free_port
from tests.factories import usage_bucket

JUNE_1 = datetime(2026, 6, 1, tzinfo=UTC)
JUNE = {"start": "2026-06-01", "end": "2026-06-30"}


def bucket(tenant_with_key, *, hour: datetime, key=True, **counters):
    api_key = tenant_with_key.api_key if key else None
    return usage_bucket(tenant_with_key.tenant, api_key, hour, endpoint="openai", **counters)


@pytest.fixture
def june(alpha, beta):
    """Folded rows for both tenants in June 2026 (and one in May, outside the range)."""
    bucket(
        alpha,
        hour=JUNE_1 + timedelta(hours=9),
        requests=3,
        succeeded=3,
        inputs=6,
        tokens=60,
        cached_inputs=2,
        cached_tokens=25,
        latency_ms_total=30,
    )
    bucket(
        alpha,
        hour=JUNE_1 + timedelta(hours=10),
        requests=2,
        succeeded=1,
        rejected=1,
        inputs=2,
        tokens=20,
        latency_ms_total=10,
    )
    bucket(
        alpha,
        hour=JUNE_1 + timedelta(days=1, hours=3),
        model="bge",
        key=False,
        requests=1,
        failed=1,
        inputs=1,
        tokens=5,
        latency_ms_total=100,
    )
    bucket(alpha, hour=JUNE_1 - timedelta(hours=1), requests=50, succeeded=50, tokens=5000)
    bucket(
        beta,
        hour=JUNE_1 + timedelta(hours=9),
        requests=7,
        succeeded=7,
        inputs=7,
        tokens=700,
        latency_ms_total=70,
    )
    return JUNE  # fmt: skip


async def get_usage(client, who, **params):
    return await client.get("/v1/usage", params=params, headers=who.headers)


def assert_error(response, status: int, param: str | None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == response.headers["x-request-id"]
    assert error["param"] == param
    return error


async def test_requires_an_api_key(client):
    response = await client.get("/v1/usage")
    assert_error(response, 401, None)
    response = await client.get("/v1/usage", headers={"Authorization": "Bearer emb_nope_nope"})
    assert response.status_code == 401


async def test_by_day_with_totals(client, alpha, june):
    response = await get_usage(client, alpha, **june)
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["object"], body["group_by"]) == ("usage", "day")
    assert (body["start"], body["end"]) == ("2026-06-01T00:00:00Z", "2026-07-01T00:00:00Z")
    assert body["totals"] == {
        "requests": 6, "succeeded": 4, "rejected": 1, "failed": 1,
        "inputs": 9, "tokens": 85, "cached_inputs": 2, "cached_tokens": 25, "computed_tokens": 60,
        "mean_latency_ms": round(140 / 6, 3),
    }  # fmt: skip
    assert [
        (row["day"], row["requests"], row["tokens"], row["cached_tokens"], row["mean_latency_ms"])
        for row in body["data"]
    ] == [
        ("2026-06-01", 5, 80, 25, 8.0),
        ("2026-06-02", 1, 5, 0, 100.0),
    ]
    assert body["includes_unfolded"] is True


async def test_by_model_and_by_key(client, alpha, june):
    body = (await get_usage(client, alpha, group_by="model", **june)).json()
    assert [(row["model"], row["requests"], row["tokens"]) for row in body["data"]] == [
        ("all-MiniLM-L6-v2", 5, 80),
        ("bge", 1, 5),
    ]
    body = (await get_usage(client, alpha, group_by="key", **june)).json()
    assert [(row["key"], row["tokens"]) for row in body["data"]] == [
        ({"id": alpha.api_key.public_id, "name": "Alpha key"}, 80),
        (None, 5),  # keyless (or deleted key) usage
    ]
    assert body["totals"]["tokens"] == 85


async def test_a_datetime_range_counts_the_hours_that_start_in_it(client, alpha, june):
    body = (await get_usage(client, alpha, start="2026-06-01T09:30:00Z", end="2026-06-01T10:00:00")).json()
    assert body["start"] == "2026-06-01T09:30:00Z"
    assert (body["totals"]["requests"], body["totals"]["tokens"]) == (3, 60)  # the 09:00 hour only


async def test_tenants_see_only_their_own_usage(client, alpha, beta, june):
    body = (await get_usage(client, beta, group_by="key", **june)).json()
    assert body["totals"]["requests"] == 7 and body["totals"]["tokens"] == 700
    assert [row["key"]["id"] for row in body["data"]] == [beta.api_key.public_id]
    # Alpha's key named in beta's query: not found, as any key that is not beta's.
    for key in (alpha.api_key.public_id, alpha.api_key.prefix, alpha.secret):
        error = assert_error(await get_usage(client, beta, key=key, **june), 404, "key")
        assert error["code"] == "api_key_not_found"
    body = (await get_usage(client, alpha, key=alpha.api_key.public_id, **june)).json()
    assert body["totals"]["tokens"] == 80  # the keyless row left out


async def test_one_key_of_several(client, alpha, june):
    other, _ = await api_key_create_async(alpha)
    await usage_record_async_at(alpha.tenant.pk, other.pk, JUNE_1 + timedelta(hours=5), tokens=9)
    body = (await get_usage(client, alpha, key=other.public_id, group_by="key", **june)).json()
    assert [(row["key"]["id"], row["tokens"]) for row in body["data"]] == [(other.public_id, 9)]


async def api_key_create_async(tenant_with_key):
    return await sync_to_async(api_key_create)(tenant=tenant_with_key.tenant, name="second")


async def usage_record_async_at(tenant_id, key_id, at: datetime, *, tokens: int, outcome="succeeded"):
    event = UsageEvent(tenant_id, key_id, "all-MiniLM-L6-v2", "openai", outcome, 1, tokens, 4, at.timestamp())
    await quota_release(reservation=None, refund=False, usage=event)


async def test_unfolded_counters_are_included_once(client, alpha, beta, june, monkeypatch):
    hour = JUNE_1 + timedelta(hours=9)
    await usage_record_async_at(alpha.tenant.pk, alpha.api_key.pk, hour, tokens=40)
    await usage_record_async_at(beta.tenant.pk, beta.api_key.pk, hour, tokens=1000)  # never alpha's
    live = (await get_usage(client, alpha, **june)).json()
    assert (live["totals"]["requests"], live["totals"]["tokens"]) == (7, 125)
    assert live["data"][0]["tokens"] == 120

    # A fold that committed but crashed before deleting its Redis batch: not counted twice.
    await usage_record_async_at(alpha.tenant.pk, alpha.api_key.pk, hour, tokens=2)

    def crash(*args):
        raise RuntimeError("crash after the commit")

    with monkeypatch.context() as patched:
        patched.setattr(usage, "_forget_batch", crash)
        with pytest.raises(RuntimeError):
            await sync_to_async(usage_fold)()
    after_crash = (await get_usage(client, alpha, **june)).json()
    assert after_crash["totals"]["tokens"] == 127
    # A batch claimed but not yet in the database counts too.
    await usage_record_async_at(alpha.tenant.pk, None, hour, tokens=3)
    with monkeypatch.context() as patched:
        patched.setattr(usage, "_add_counters_to_buckets", crash)
        with pytest.raises(RuntimeError):
            await sync_to_async(usage_fold)()
    before_fold = (await get_usage(client, alpha, **june)).json()["totals"]
    assert (before_fold["requests"], before_fold["tokens"]) == (9, 130)

    await sync_to_async(usage_fold)()
    assert (await get_usage(client, alpha, **june)).json()["totals"] == before_fold
    beta_body = (await get_usage(client, beta, **june)).json()
    assert beta_body["totals"]["tokens"] == 1700


async def test_default_range_is_this_utc_month(client, alpha):
    now = datetime.now(UTC)
    await usage_record_async_at(alpha.tenant.pk, alpha.api_key.pk, now, tokens=11)
    body = (await get_usage(client, alpha)).json()
    month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    assert body["start"] == month_start.isoformat().replace("+00:00", "Z")
    assert body["totals"]["tokens"] == 11
    assert [row["day"] for row in body["data"]] == [now.date().isoformat()]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"start": "yesterday"}, "start"),
        ({"start": "2026-13-01"}, "start"),
        ({"end": "2026-06-31"}, "end"),
        ({"start": "2026-06-10", "end": "2026-06-09"}, "end"),
        ({"start": "2026-06-10T10:00:00Z", "end": "2026-06-10T10:00:00Z"}, "end"),
        ({"start": "2025-01-01", "end": "2026-06-01"}, "start"),
        ({"group_by": "week"}, "group_by"),
        # Dates at datetime's limits, far-future offsets, nonsense and huge numbers: 422, never a 500.
        ({"start": "9999-12-31", "end": "9999-12-31"}, "end"),
        ({"start": "9999-12-30"}, "start"),
        ({"start": "0001-01-01", "end": "0001-01-02"}, "end"),
        ({"start": "0001-01-01T00:00:00+01:00"}, "start"),
        ({"end": "9999-12-31T23:59:59-23:59"}, "end"),
        ({"end": "9999-12-31T23:59:59.999999"}, "end"),
        ({"start": "1969-12-31T23:00:00Z"}, "start"),
        ({"start": "NaN"}, "start"),
        ({"end": "inf"}, "end"),
        ({"start": "99999999999999999999"}, "start"),
        ({"start": "1e308"}, "start"),
        ({"start": "2026-06-10\x00"}, "start"),
        # A key is named by its public id (or the key itself): any other string is no key's.
        ({"key": "not a key"}, "key"),
        ({"key": " abcdefghijkl"}, "key"),
    ],
)
async def test_invalid_queries_are_422(client, alpha, params, param):
    assert_error(await get_usage(client, alpha, **params), 422, param)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"start": "2026-06-10", "end": "2026-06-09"}, "end"),
        ({"start": "2025-01-01", "end": "2026-06-01"}, "start"),
        ({"start": "1969-12-31T23:00:00Z"}, "start"),
        ({"end": "9999-12-31T23:59:59-23:59"}, "end"),
    ],
)
async def test_a_range_refused_for_where_it_lies_says_so(client, alpha, params, param):
    """Each bound is a date or date-time as the schema says; what the schema cannot say (how the
    two relate, the years served) has its own code."""
    assert assert_error(await get_usage(client, alpha, **params), 422, param)["code"] == "invalid_range"
    malformed = await get_usage(client, alpha, start="2026-13-01")
    assert assert_error(malformed, 422, "start")["code"] == "invalid_value"


async def test_the_last_representable_range_is_answered(client, alpha):
    response = await get_usage(client, alpha, start="9998-12-01", end="9998-12-31")
    assert response.status_code == 200, response.text
    assert response.json()["end"] == "9999-01-01T00:00:00Z"


async def test_empty_bounds_are_the_defaults(client, alpha):
    response = await get_usage(client, alpha, start="", end="", key="")
    assert response.status_code == 200, response.text
    assert response.json()["start"].endswith("-01T00:00:00Z")


async def test_quota_state_is_included(client, alpha, beta, model):
    tenant = alpha.tenant
    tenant.tokens_per_month = 1000
    await sync_to_async(tenant.save)(update_fields=["tokens_per_month"])
    assert (await get_usage(client, alpha)).json()["quota"]["tenant"]["tokens_per_month"]["used"] == 0
    used = 0
    # Two requests of alpha's, one of beta's (which must not count against alpha's quota).
    for who, text in ((alpha, "hello"), (beta, "beta's text"), (alpha, "a second, longer request")):
        embedded = await client.post(
            "/v1/embeddings", json={"model": model.name, "input": text}, headers=who.headers
        )
        assert embedded.status_code == 200, embedded.text
        used += embedded.json()["usage"]["total_tokens"] if who is alpha else 0
    quota = (await get_usage(client, alpha)).json()["quota"]
    month = quota["tenant"]["tokens_per_month"]
    assert (month["limit"], month["used"], month["remaining"]) == (1000, used, 1000 - used)
    assert quota["tenant"]["requests_per_minute"]["limit"] is None


async def test_real_requests_are_counted_exactly_after_the_fold(client, alpha, beta, model):
    """Embedding requests through the API (some refused by the daily budget), folded halfway and at
    the end: the database and /v1/usage hold exactly what the responses said."""

    tenant = alpha.tenant
    tenant.tokens_per_day = 150
    await sync_to_async(tenant.save)(update_fields=["tokens_per_day"])
    texts = [["hello"], ["a somewhat longer sentence to embed"], ["one", "two", "three"]]

    async def embed(index: int):
        return await client.post(
            "/v1/embeddings", json={"model": model.name, "input": texts[index % 3]}, headers=alpha.headers
        )

    responses = list(await asyncio.gather(*(embed(i) for i in range(12))))
    await sync_to_async(usage_fold)()
    responses += await asyncio.gather(*(embed(i) for i in range(12, 30)))
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert accepted and refused and len(accepted) + len(refused) == 30
    assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
    tokens = sum(r.json()["usage"]["total_tokens"] for r in accepted)
    inputs = sum(len(r.json()["data"]) for r in accepted)
    assert tokens <= 150
    expected = {
        "requests": 30, "succeeded": len(accepted), "rejected": len(refused), "failed": 0,
        "inputs": inputs, "tokens": tokens,
    }  # fmt: skip

    def usage_totals(body):
        return {metric: body["totals"][metric] for metric in expected}

    before_fold = (await get_usage(client, alpha, group_by="model")).json()
    assert usage_totals(before_fold) == expected
    await sync_to_async(usage_fold)()
    after_fold = (await get_usage(client, alpha, group_by="model")).json()
    assert usage_totals(after_fold) == expected
    assert [row["model"] for row in after_fold["data"]] == [model.name]

    def database_totals():
        rows = UsageBucket.objects.filter(tenant=tenant, api_key=alpha.api_key, endpoint="openai")
        return rows.aggregate(**{metric: Sum(metric) for metric in expected})

    assert await sync_to_async(database_totals)() == expected
    assert (await get_usage(client, beta)).json()["totals"]["requests"] == 0


async def test_requests_record_the_variant_that_served_them(client, alpha, model):
    """The bundled model, pinned to its float32 version 1, through the express lane
    (/v1/embeddings) and a view (/embed): /v1/usage by variant says which served, before the fold
    and after it, and so do the rows; a row from before variants were recorded has them null."""
    hour = usage.hour_floor(datetime.now(UTC))
    await sync_to_async(usage_bucket)(
        alpha.tenant, alpha.api_key, hour, model=model.name, endpoint="openai", requests=1, tokens=3
    )
    openai = await client.post(
        "/v1/embeddings", json={"model": model.name, "input": "hello"}, headers=alpha.headers
    )
    tei = await client.post("/embed", json={"inputs": ["a second text"]}, headers=alpha.headers)
    assert openai.status_code == tei.status_code == 200, (openai.text, tei.text)
    tokens = openai.json()["usage"]["total_tokens"] + tei.json()["usage"]["total_tokens"]
    expected = [
        {"model": model.name, "model_version": None, "model_dtype": None, "requests": 1, "tokens": 3},
        {
            "model": model.name,
            "model_version": "1",
            "model_dtype": "float32",
            "requests": 2,
            "tokens": tokens,
        },
    ]

    def variants(body: dict) -> list[dict]:
        fields = ("model", "model_version", "model_dtype", "requests", "tokens")
        return [{field: row[field] for field in fields} for row in body["data"]]

    before_fold = (await get_usage(client, alpha, group_by="variant")).json()
    assert before_fold["group_by"] == "variant"
    assert variants(before_fold) == expected
    await sync_to_async(usage_fold)()
    assert variants((await get_usage(client, alpha, group_by="variant")).json()) == expected

    def recorded():
        rows = UsageBucket.objects.filter(tenant=alpha.tenant).order_by("model_version", "endpoint")
        return [(row.endpoint, row.model_version, row.model_dtype, row.requests) for row in rows]

    assert await sync_to_async(recorded)() == [
        ("openai", "", "", 1),
        ("openai", "1", "float32", 1),
        ("tei", "1", "float32", 1),
    ]


async def test_redis_down_still_answers_with_folded_usage(client, alpha, june, settings, tmp_path):
    alpha.tenant.tokens_per_month = 1000  # a limit: its window lives in Redis
    await sync_to_async(alpha.tenant.save)(update_fields=["tokens_per_month"])
    await usage_record_async_at(alpha.tenant.pk, alpha.api_key.pk, JUNE_1 + timedelta(hours=9), tokens=40)
    with RedisServer(port=free_port(), data_dir=tmp_path, persistent=False) as stopped:
        url = stopped.url
    settings.REDIS_URL = url  # nothing listens there any more
    settings.REDIS_TIMEOUT_S = 0.5
    reset_redis_clients()
    response = await get_usage(client, alpha, **june)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["includes_unfolded"] is False
    assert body["totals"]["tokens"] == 85  # the folded rows only; the 40 are still in Redis
    assert body["quota"] is None  # unknown, rather than a wrong "used": 0
