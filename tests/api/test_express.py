"""The express lane of POST /v1/embeddings (embeddings/api/express.py) answers as the view does.

Each case is sent twice, in process through the whole ASGI application: once by Alpha with the
lane off (the view answers), once by Beta with it on. The two tenants are alike (same limits, same
models), so whatever the quota headers say is the same for both: the answers must match byte for
byte but for what differs between any two requests (the request id, Server-Timing's durations).
Each case also says whether the lane takes it or leaves it to the view, checked by counting its
calls. The shipped server's own tests (tests/api/test_embeddings.py and others, through uvicorn)
go through the lane whenever it takes the request.
"""

from __future__ import annotations

import re
import time

import pytest
from asgiref.sync import sync_to_async

from embeddings.api import express
from embeddings.api.authentication import caller_cache
from embeddings.redis.connections import redis_sync
from embeddings.services.accounts.tenants import quota_limits_update
from embeddings.services.quotas import limits as quotas
from embeddings.services.quotas.usage import LIVE_USAGE_KEY, parse_usage_field

JSON = {"Content-Type": "application/json"}
VOLATILE_HEADERS = {"x-request-id", "server-timing", "date"}


@pytest.fixture(autouse=True)
def one_window(monkeypatch):
    """Both requests of a case fall into one pinned minute (no bucket refills between them)."""
    pinned = time.time() // 60 * 60 + 30
    monkeypatch.setattr(quotas, "clock", lambda: pinned)
    monkeypatch.setattr(quotas, "rates_on_redis_clock", False)


@pytest.fixture
def lane_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    answer = express.express_answer

    async def counted(*args, **kwargs):
        calls.append(1)
        return await answer(*args, **kwargs)

    monkeypatch.setattr(express, "express_answer", counted)
    return calls


def comparable(response) -> tuple:
    """Status, headers in order (volatile values masked) and body (request id masked)."""
    headers = []
    for name, value in response.headers.raw:
        name = name.decode("latin-1").lower()
        if name == "server-timing":
            value = re.sub(rb"dur=[0-9.]+", b"dur=*", value)
        elif name in VOLATILE_HEADERS:
            value = b"*"
        headers.append((name, value))
    body = response.content.replace(response.headers.get("x-request-id", "").encode(), b"<request id>")
    return response.status_code, headers, body


# What differs between Alpha's and Beta's log lines, or any two requests': who, and how long.
LOG_VARIABLES = re.compile(r"(tenant|key|key_id)=\S+|[0-9.]+ ms|inference_ms=[0-9.]+")


def logged(caplog, since: int, until: int | None = None) -> list[tuple]:
    return [
        (record.name, record.levelname, LOG_VARIABLES.sub("*", record.getMessage()))
        for record in caplog.records[since:until]
        if record.name != "httpx2"
    ]


@pytest.fixture
def both_ways(client, settings, alpha, beta, lane_calls, caplog):
    """Send a case by Alpha through the view and by Beta through the lane; check both answers (and
    the lines they logged) alike, and whether the lane took it; return the view's answer."""

    async def send(*, express_takes: bool, headers: dict | None = None, **request):
        settings.EXPRESS_EMBEDDINGS = False
        view_logged = len(caplog.records)
        by_view = await client.post(
            "/v1/embeddings", headers={**JSON, **alpha.headers, **(headers or {})}, **request
        )
        settings.EXPRESS_EMBEDDINGS = True
        taken_before, lane_logged = len(lane_calls), len(caplog.records)
        by_lane = await client.post(
            "/v1/embeddings", headers={**JSON, **beta.headers, **(headers or {})}, **request
        )
        assert (len(lane_calls) > taken_before) is express_takes
        assert comparable(by_lane) == comparable(by_view)
        assert logged(caplog, lane_logged) == logged(caplog, view_logged, lane_logged)
        return by_view

    return send


TAKEN = [
    pytest.param({"model": "minilm", "input": "hello"}, 200, id="one text"),
    pytest.param(
        {
            "model": "minilm",
            "input": ["a", "b c"],
            "encoding_format": "base64",
            "dimensions": 8,
            "user": "u1",
        },
        200,
        id="texts, base64, dimensions, user",
    ),
    pytest.param({"model": "minilm", "input": [[101, 7592, 102], [101, 102]]}, 200, id="token ids"),
    pytest.param({"model": "minilm", "input": "x", "dimensions": None, "extra": 1}, 200, id="unknown field"),
    pytest.param({"input": "hello", "model": "nope"}, 404, id="no such model"),
    pytest.param(
        {"model": "minilm", "input": "x", "dimensions": 9999}, 422, id="more dimensions than the model"
    ),
    pytest.param({"model": "minilm", "input": [[10**9]]}, 422, id="token id outside the vocabulary"),
]
DECLINED = [
    pytest.param({"model": "minilm", "input": ""}, 422, id="empty text"),
    pytest.param({"input": "hello"}, 422, id="no model"),
    pytest.param({"model": "minilm", "input": "x", "encoding_format": "int8"}, 422, id="unknown encoding"),
    pytest.param({"model": "minilm", "input": "x", "dimensions": "8"}, 422, id="dimensions as text"),
    pytest.param({"model": "minilm", "input": "x", "user": 5}, 422, id="user as a number"),
    pytest.param(["hello"], 422, id="an array body"),
]


@pytest.mark.parametrize(("body", "status"), TAKEN)
async def test_what_the_lane_takes_it_answers_as_the_view(both_ways, body, status):
    by_view = await both_ways(express_takes=True, json=body)
    assert by_view.status_code == status


@pytest.mark.parametrize(("body", "status"), DECLINED)
async def test_a_body_the_view_refuses_is_left_to_it(both_ways, body, status):
    by_view = await both_ways(express_takes=False, json=body)
    assert by_view.status_code == status


@pytest.mark.parametrize(
    ("request_options", "status"),
    [
        pytest.param({"content": b'{"model": "minilm", "input": "x"', "headers": {}}, 400, id="not JSON"),
        pytest.param(
            {"content": b'{"model": "minilm", "input": "x"}', "headers": {"Content-Type": "text/plain"}},
            415,
            id="not a JSON media type",
        ),
        pytest.param(
            {
                "json": {"model": "minilm", "input": "x"},
                "headers": {"Content-Type": "application/json; charset=latin-1"},
            },
            415,
            id="a charset other than UTF-8",
        ),
        pytest.param({"content": b"", "headers": {}}, 422, id="no body"),
        pytest.param(
            {"json": {"model": "minilm", "input": "x"}, "headers": {"Host": "elsewhere.example"}},
            400,
            id="foreign Host",
        ),
    ],
)
async def test_a_request_only_the_view_can_read_is_left_to_it(both_ways, request_options, status):
    by_view = await both_ways(express_takes=False, **request_options)
    assert by_view.status_code == status


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer emb_aaaaaaaaaaaa_bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
        "Bearer not-a-key",
        "Basic dXNlcjpwYXNz",
    ],
)
async def test_keys_are_refused_alike(both_ways, authorization):
    body = {"model": "minilm", "input": "hello"}
    by_view = await both_ways(express_takes=True, json=body, headers={"Authorization": authorization})
    assert by_view.status_code == 401


async def test_no_key_is_left_to_the_view(client, lane_calls):
    answer = await client.post("/v1/embeddings", json={"model": "minilm", "input": "hello"})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "missing_api_key"
    assert lane_calls == []


async def test_a_model_the_key_may_not_use_is_refused_alike(both_ways, alpha, beta):
    for who in (alpha, beta):
        who.tenant.allow_all_models = False
        await sync_to_async(who.tenant.save)()
    caller_cache.clear()
    by_view = await both_ways(express_takes=True, json={"model": "minilm", "input": "x"})
    assert by_view.status_code == 403


def usage_of(tenant_id: int) -> dict[tuple[str, str, str], int]:
    """The tenant's counters by (metric, model version, dtype): the variant is recorded alike too."""
    totals: dict[tuple[str, str, str], int] = {}
    for field, value in redis_sync().hgetall(LIVE_USAGE_KEY).items():
        bucket, metric = parse_usage_field(field.decode())
        if bucket.tenant_id == tenant_id and not metric.startswith("latency"):  # latency: each its own
            counter = (metric, bucket.model_version, bucket.model_dtype)
            totals[counter] = totals.get(counter, 0) + int(value)
    return totals


async def test_quotas_admit_refuse_and_count_alike(both_ways, alpha, beta):
    for who in (alpha, beta):
        await sync_to_async(quota_limits_update)(
            owner=who.tenant,
            limits={"requests_per_minute": 2, "request_burst": 2, "tokens_per_minute": 10_000},
        )
    caller_cache.clear()
    statuses = []
    for text in ("one", "two words", "three"):
        by_view = await both_ways(express_takes=True, json={"model": "minilm", "input": text})
        statuses.append(by_view.status_code)
    assert statuses == [200, 200, 429]
    assert usage_of(alpha.tenant.pk) == usage_of(beta.tenant.pk) != {}
    assert {(version, dtype) for _, version, dtype in usage_of(alpha.tenant.pk)} == {("1", "float32")}


async def test_a_host_allowed_before_is_asked_again_once_allowed_hosts_change(both_ways, settings):
    body = {"model": "minilm", "input": "x"}
    await both_ways(express_takes=True, json=body)  # testserver: allowed, and remembered
    settings.ALLOWED_HOSTS = ["only.example"]
    by_view = await both_ways(express_takes=False, json=body)
    assert by_view.status_code == 400 and by_view.json()["error"]["code"] == "invalid_host"
