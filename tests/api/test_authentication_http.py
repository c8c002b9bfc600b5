"""API keys through the real ASGI app and the real Triton: statuses, codes, cache TTL, tenants apart.

The authenticator's own cases (cache, refusals, callers) are in test_authentication.py; these
check what a client sees on the wire, on every authenticated route.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from embeddings.api import authentication
from embeddings.models import ApiKey
from embeddings.services.accounts.api_keys import api_key_revoke
from embeddings.services.accounts.tenants import tenant_deactivate
from tests.api.test_embeddings import assert_error
from tests.clocks import ManualClock
from tests.conftest import tenant_with_key

EMBEDDINGS = {"model": "minilm", "input": "hello world"}
AUTHENTICATED_ROUTES = [
    ("POST", "/v1/embeddings", EMBEDDINGS),
    ("POST", "/v1/embedding", [{"query": "hello world"}]),
    ("POST", "/api/v1/embed", {"inputs": "hello world"}),
    ("POST", "/embed", {"inputs": "hello world"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/minilm", None),
]


@pytest.fixture(autouse=True)
def cache_clock(monkeypatch) -> Iterator[ManualClock]:
    """An empty key cache (process-wide: earlier tests' entries must not leak into these) reading a
    clock the test moves, so its TTL is crossed without sleeping."""
    authentication.caller_cache.clear()
    clock = ManualClock()
    monkeypatch.setattr(authentication.caller_cache, "clock", clock)
    yield clock
    authentication.caller_cache.clear()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def embed(client, headers: dict[str, str]):
    return await client.post("/v1/embeddings", json=EMBEDDINGS, headers=headers)


async def model_ids(client, headers: dict[str, str]) -> list[str]:
    response = await client.get("/v1/models", headers=headers)
    assert response.status_code == 200, response.text
    return [model["id"] for model in response.json()["data"]]


@pytest.mark.parametrize(("method", "path", "body"), AUTHENTICATED_ROUTES)
async def test_every_api_route_needs_a_key(client, model, method, path, body):
    response = await client.request(method, path, json=body)
    error = assert_error(response, 401, code="missing_api_key")
    assert "Authorization: Bearer" in error["message"]


async def test_the_key_opens_every_api_route(client, alpha):
    for method, path, body in AUTHENTICATED_ROUTES:
        response = await client.request(method, path, json=body, headers=alpha.headers)
        assert response.status_code == 200, (path, response.text)


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        ("Basic dXNlcjpwYXNz", "invalid_api_key"),  # wrong scheme
        ("Bearer", "invalid_api_key"),  # scheme without a key
        ("Bearer garbage", "malformed_api_key"),
        ("Bearer sk-proj-" + "a" * 40, "malformed_api_key"),  # someone else's key format
    ],
)
async def test_wrong_scheme_and_garbage_are_401(client, alpha, authorization, code):
    assert_error(await embed(client, {"Authorization": authorization}), 401, code=code)


async def test_right_key_under_another_scheme_is_401(client, alpha):
    assert_error(await embed(client, {"Authorization": f"Token {alpha.secret}"}), 401, code="invalid_api_key")


async def test_right_public_id_wrong_secret_is_401(client, alpha, beta):
    secret = alpha.secret.split("_", 2)[2]
    wrong_secret = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    assert_error(
        await embed(client, bearer(f"emb_{alpha.api_key.public_id}_{wrong_secret}")),
        401,
        code="invalid_api_key",
    )
    # Alpha's secret under beta's public id is no key at all.
    assert_error(
        await embed(client, bearer(f"emb_{beta.api_key.public_id}_{secret}")), 401, code="invalid_api_key"
    )


async def test_revoked_key_works_until_the_cache_ttl_then_is_401(client, alpha, beta, settings, cache_clock):
    assert (await client.get("/v1/models", headers=alpha.headers)).status_code == 200  # now cached

    await sync_to_async(api_key_revoke)(api_key=alpha.api_key)
    cache_clock.advance(settings.API_KEY_CACHE_SECONDS)  # the TTL's last instant
    assert (await client.get("/v1/models", headers=alpha.headers)).status_code == 200

    cache_clock.advance(0.001)
    error = assert_error(await embed(client, alpha.headers), 401, code="api_key_revoked")
    assert "revoked" in error["message"]
    assert_error(await client.get("/v1/models", headers=alpha.headers), 401, code="api_key_revoked")
    assert (await embed(client, beta.headers)).status_code == 200  # the other tenant is untouched


async def test_revoked_before_first_use_is_401_at_once(client, alpha):
    await sync_to_async(api_key_revoke)(api_key=alpha.api_key)
    assert_error(await embed(client, alpha.headers), 401, code="api_key_revoked")


async def test_expired_key_is_401(client, alpha):
    expired = await sync_to_async(tenant_with_key)(
        "Expired", expires_at=timezone.now() - timedelta(seconds=1)
    )
    error = assert_error(await embed(client, expired.headers), 401, code="api_key_expired")
    assert "expired" in error["message"]


async def test_key_expiring_while_cached_is_refused_without_waiting_for_the_ttl(
    client, model, settings, monkeypatch
):
    settings.API_KEY_CACHE_SECONDS = 60.0
    expires_at = timezone.now() + timedelta(hours=1)
    soon = await sync_to_async(tenant_with_key)("Soon", expires_at=expires_at)
    assert (await client.get("/v1/models", headers=soon.headers)).status_code == 200  # cached for 60 s

    # The cache's clock stands still; the authenticator's time of day passes the key's expiry.
    monkeypatch.setattr(authentication, "timezone", SimpleNamespace(now=lambda: expires_at))
    assert_error(await embed(client, soon.headers), 401, code="api_key_expired")


async def test_inactive_tenant_is_403(client, alpha, beta):
    await sync_to_async(tenant_deactivate)(tenant=beta.tenant)

    assert_error(await embed(client, beta.headers), 403, code="tenant_inactive")
    assert_error(await client.get("/v1/models", headers=beta.headers), 403, code="tenant_inactive")
    assert (await embed(client, alpha.headers)).status_code == 200


async def test_restricted_tenant_without_models_is_403_until_the_model_is_allowed(
    client, model, settings, cache_clock
):
    restricted = await sync_to_async(tenant_with_key)("Gamma", allow_all_models=False)

    error = assert_error(
        await embed(client, restricted.headers), 403, code="model_not_allowed", param="model"
    )
    assert "all-MiniLM-L6-v2" in error["message"]
    assert_error(
        await client.post("/api/v1/embed", json={"inputs": "x"}, headers=restricted.headers),
        403,
        code="model_not_allowed",
    )  # the seed routes use the default model, which this tenant may not use either
    assert_error(await client.get("/v1/models/minilm", headers=restricted.headers), 403)
    assert await model_ids(client, restricted.headers) == []

    await restricted.tenant.allowed_models.aadd(model)
    cache_clock.advance(settings.API_KEY_CACHE_SECONDS + 0.001)

    response = await embed(client, restricted.headers)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"][0]["embedding"]) == 384
    assert await model_ids(client, restricted.headers) == ["all-MiniLM-L6-v2"]


async def test_last_used_at_is_set_then_not_rewritten_within_a_minute(
    client, alpha, beta, settings, cache_clock
):
    assert alpha.api_key.last_used_at is None
    before = timezone.now()
    assert (await embed(client, alpha.headers)).status_code == 200

    first = (await ApiKey.objects.aget(pk=alpha.api_key.pk)).last_used_at
    assert first is not None and before <= first <= timezone.now()

    cache_clock.advance(settings.API_KEY_CACHE_SECONDS + 0.001)  # past the cache: the key is re-read
    assert (await embed(client, alpha.headers)).status_code == 200
    assert (await ApiKey.objects.aget(pk=alpha.api_key.pk)).last_used_at == first
    assert (await ApiKey.objects.aget(pk=beta.api_key.pk)).last_used_at is None


async def test_each_key_authenticates_as_its_own_tenant(
    client, alpha, beta, model, caplog, settings, cache_clock
):
    caplog.set_level(logging.INFO, logger="embeddings.requests")
    for tenant in (alpha, beta, alpha):
        assert (await embed(client, tenant.headers)).status_code == 200

    logged = [record.getMessage() for record in caplog.records if record.name == "embeddings.requests"]
    callers = [line.split(" model=")[0].split("endpoint=openai ")[1] for line in logged]
    assert callers == [
        f"tenant=alpha key={alpha.api_key.public_id}",
        f"tenant=beta key={beta.api_key.public_id}",
        f"tenant=alpha key={alpha.api_key.public_id}",
    ]
    assert alpha.secret not in caplog.text and beta.secret not in caplog.text  # keys are never logged

    # Restricting beta changes what beta's key may do, and nothing about alpha's.
    await sync_to_async(restrict_to_listed_models)(beta.tenant)
    cache_clock.advance(settings.API_KEY_CACHE_SECONDS + 0.001)
    assert await model_ids(client, alpha.headers) == ["all-MiniLM-L6-v2"]
    assert await model_ids(client, beta.headers) == []
    assert (await embed(client, alpha.headers)).status_code == 200
    assert_error(await embed(client, beta.headers), 403, code="model_not_allowed")


def restrict_to_listed_models(tenant) -> None:
    tenant.allow_all_models = False
    tenant.save(update_fields=["allow_all_models"])
