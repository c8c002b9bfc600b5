"""The async API key authenticator, driven directly with DRF request objects (endpoints: test_embeddings)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError
from django.utils import timezone
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory

from embeddings.api import authentication
from embeddings.api.authentication import ApiKeyAuthentication, ensure_model_allowed
from embeddings.callers import Caller
from embeddings.errors.answers import Forbidden, ModelForbidden, Unauthorized
from embeddings.models import ApiKey, EmbeddingModel, Tenant
from embeddings.services.accounts.api_keys import api_key_create, api_key_revoke
from embeddings.services.accounts.tenants import tenant_deactivate
from tests.clocks import ManualClock

pytestmark = pytest.mark.django_db(transaction=True)


def drf_request(authorization: str | None) -> Request:
    headers = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization}
    return Request(APIRequestFactory().post("/v1/embeddings", {}, format="json", **headers))


async def authenticate(authorization: str | None):
    return await ApiKeyAuthentication().authenticate(drf_request(authorization))


@pytest.fixture(autouse=True)
def cache_clock(settings, monkeypatch) -> Iterator[ManualClock]:
    """An empty key cache reading a clock the test moves: TTLs are crossed without sleeping."""
    settings.API_KEY_CACHE_SECONDS = 5.0
    authentication.caller_cache.clear()
    clock = ManualClock()
    monkeypatch.setattr(authentication.caller_cache, "clock", clock)
    yield clock
    authentication.caller_cache.clear()


@pytest.fixture
def database_reads(monkeypatch) -> list[str]:
    """Each key the authenticator looked up in the database."""
    reads: list[str] = []
    resolve = authentication._caller_for_key

    def counting(key: str):
        reads.append(key)
        return resolve(key)

    monkeypatch.setattr(authentication, "_caller_for_key", counting)
    return reads


@pytest.fixture
def setup(transactional_db, two_tenants):
    """The two tenants, Beta restricted to the e5 model."""
    minilm = EmbeddingModel.objects.create(
        name="all-MiniLM-L6-v2", triton_model="minilm", dimensions=384, max_tokens=256
    )
    e5 = EmbeddingModel.objects.create(name="e5-small", triton_model="e5", dimensions=384, max_tokens=512)
    alpha, beta = two_tenants.alpha, two_tenants.beta
    beta.tenant.allow_all_models = False
    beta.tenant.save(update_fields=["allow_all_models"])
    beta.tenant.allowed_models.add(e5)
    return SimpleNamespace(
        minilm=minilm,
        e5=e5,
        alpha=alpha.tenant,
        beta=beta.tenant,
        alpha_key=alpha.api_key,
        alpha_secret=alpha.secret,
        beta_key=beta.api_key,
        beta_secret=beta.secret,
    )


async def test_valid_key_gives_the_tenants_caller(setup):
    caller, auth = await authenticate(f"Bearer {setup.alpha_secret}")

    assert auth is None
    assert caller == Caller(
        tenant_id=setup.alpha.pk,
        tenant_slug="alpha",
        key_id=setup.alpha_key.pk,
        key_public_id=setup.alpha_key.public_id,
        allow_all_models=True,
        allowed_model_ids=frozenset(),
    )
    assert caller.is_authenticated
    with pytest.raises(dataclasses.FrozenInstanceError):
        caller.tenant_id = setup.beta.pk


async def test_two_tenants_get_their_own_callers(setup):
    alpha, _ = await authenticate(f"Bearer {setup.alpha_secret}")
    beta, _ = await authenticate(f"Bearer {setup.beta_secret}")

    assert (alpha.tenant_id, alpha.key_id) == (setup.alpha.pk, setup.alpha_key.pk)
    assert (beta.tenant_id, beta.key_id) == (setup.beta.pk, setup.beta_key.pk)
    assert beta.allowed_model_ids == frozenset({setup.e5.pk})


async def test_scheme_is_case_insensitive(setup):
    caller, _ = await authenticate(f"bearer {setup.alpha_secret}")
    assert caller.tenant_slug == "alpha"


@pytest.mark.parametrize(
    ("authorization", "code", "message"),
    [
        (None, "missing_api_key", "didn't provide an API key"),
        ("", "missing_api_key", "didn't provide an API key"),
        ("Bearer", "invalid_api_key", "Authorization: Bearer"),
        ("Bearer   ", "invalid_api_key", "Authorization: Bearer"),
        ("Basic dXNlcjpwYXNz", "invalid_api_key", "Authorization: Bearer"),
        ("Token emb_abcdefghij12_" + "s" * 43, "invalid_api_key", "Authorization: Bearer"),
        ("Bearer sk-proj-abc", "malformed_api_key", "Malformed API key"),
        ("Bearer emb_short", "malformed_api_key", "Malformed API key"),
    ],
)
async def test_missing_or_malformed_header_is_401_without_the_database(
    setup, database_reads, authorization, code, message
):
    with pytest.raises(Unauthorized) as refused:
        await authenticate(authorization)

    assert refused.value.status == 401
    assert refused.value.error_code == code
    assert message in refused.value.message
    assert database_reads == []
    assert authentication.caller_cache.entries == {}


async def test_wrong_secret_is_401(setup):
    wrong = setup.alpha_secret[:-2] + ("AA" if not setup.alpha_secret.endswith("AA") else "BB")
    with pytest.raises(Unauthorized) as refused:
        await authenticate(f"Bearer {wrong}")

    assert refused.value.error_code == "invalid_api_key"
    assert refused.value.message == "Incorrect API key provided."


async def test_another_tenants_public_id_with_my_secret_is_401(setup):
    secret = setup.alpha_secret.split("_", 2)[2]
    with pytest.raises(Unauthorized):
        await authenticate(f"Bearer emb_{setup.beta_key.public_id}_{secret}")


async def test_revoked_key_is_401(setup):
    await sync_to_async(api_key_revoke)(api_key=setup.alpha_key)

    with pytest.raises(Unauthorized) as refused:
        await authenticate(f"Bearer {setup.alpha_secret}")

    assert refused.value.error_code == "api_key_revoked"
    assert "revoked" in refused.value.message


async def test_expired_key_is_401(setup):
    _, secret = await sync_to_async(api_key_create)(
        tenant=setup.alpha, name="old", expires_at=timezone.now() - timedelta(seconds=1)
    )

    with pytest.raises(Unauthorized) as refused:
        await authenticate(f"Bearer {secret}")

    assert refused.value.error_code == "api_key_expired"
    assert "expired" in refused.value.message


async def test_key_expiring_while_cached_is_refused_at_once(setup, monkeypatch):
    expires_at = timezone.now() + timedelta(hours=1)
    _, secret = await sync_to_async(api_key_create)(tenant=setup.alpha, name="soon", expires_at=expires_at)
    await authenticate(f"Bearer {secret}")  # cached now

    later = SimpleNamespace(now=lambda: expires_at + timedelta(seconds=1))
    monkeypatch.setattr(authentication, "timezone", later)
    with pytest.raises(Unauthorized) as refused:
        await authenticate(f"Bearer {secret}")
    assert refused.value.error_code == "api_key_expired"


async def test_inactive_tenant_is_403(setup):
    await sync_to_async(tenant_deactivate)(tenant=setup.alpha)

    with pytest.raises(Forbidden) as refused:
        await authenticate(f"Bearer {setup.alpha_secret}")

    assert refused.value.status == 403
    assert refused.value.error_code == "tenant_inactive"
    # The other tenant is unaffected.
    caller, _ = await authenticate(f"Bearer {setup.beta_secret}")
    assert caller.tenant_slug == "beta"


async def test_cached_key_works_until_the_ttl_then_revocation_applies(
    setup, settings, database_reads, cache_clock
):
    await authenticate(f"Bearer {setup.alpha_secret}")
    await sync_to_async(api_key_revoke)(api_key=setup.alpha_key)

    cache_clock.advance(settings.API_KEY_CACHE_SECONDS)  # the last instant of the TTL
    caller, _ = await authenticate(f"Bearer {setup.alpha_secret}")  # within the TTL: cached
    assert caller.key_id == setup.alpha_key.pk
    assert len(database_reads) == 1

    cache_clock.advance(0.001)
    with pytest.raises(Unauthorized) as refused:
        await authenticate(f"Bearer {setup.alpha_secret}")
    assert refused.value.error_code == "api_key_revoked"
    assert len(database_reads) == 2


async def test_requests_that_find_the_key_expired_together_read_it_once(
    setup, settings, database_reads, cache_clock
):
    """Under load an expired entry is missed by every request in flight: one read serves them all
    (and a refusal alike)."""
    callers = await asyncio.gather(*(authenticate(f"Bearer {setup.alpha_secret}") for _ in range(20)))
    assert {caller.key_id for caller, _ in callers} == {setup.alpha_key.pk}
    assert len(database_reads) == 1
    cache_clock.advance(settings.API_KEY_CACHE_SECONDS + 0.001)
    await sync_to_async(api_key_revoke)(api_key=setup.alpha_key)
    refusals = await asyncio.gather(
        *(authenticate(f"Bearer {setup.alpha_secret}") for _ in range(20)), return_exceptions=True
    )
    assert {type(refusal) for refusal in refusals} == {Unauthorized}
    assert len(database_reads) == 2


async def test_tenant_deactivation_applies_after_the_ttl(setup, settings, cache_clock):
    await authenticate(f"Bearer {setup.alpha_secret}")
    await sync_to_async(tenant_deactivate)(tenant=setup.alpha)

    cache_clock.advance(settings.API_KEY_CACHE_SECONDS - 0.001)
    await authenticate(f"Bearer {setup.alpha_secret}")  # still cached as active
    cache_clock.advance(0.002)
    with pytest.raises(Forbidden):
        await authenticate(f"Bearer {setup.alpha_secret}")


async def test_refusals_are_cached_briefly(setup, settings, database_reads, cache_clock):
    settings.API_KEY_CACHE_SECONDS = 60.0
    await sync_to_async(tenant_deactivate)(tenant=setup.alpha)
    for _ in range(5):
        with pytest.raises(Forbidden):
            await authenticate(f"Bearer {setup.alpha_secret}")
        cache_clock.advance(authentication.NEGATIVE_CACHE_SECONDS / 5)
    assert len(database_reads) == 1  # hammering does not reach the database

    setup.alpha.is_active = True
    await sync_to_async(setup.alpha.save)(update_fields=["is_active"])
    cache_clock.advance(0.001)  # a refusal is kept far shorter than API_KEY_CACHE_SECONDS
    caller, _ = await authenticate(f"Bearer {setup.alpha_secret}")
    assert caller.tenant_slug == "alpha"
    assert len(database_reads) == 2


async def test_negative_cache_is_at_most_a_second(setup, settings, cache_clock):
    settings.API_KEY_CACHE_SECONDS = 60.0
    assert authentication.NEGATIVE_CACHE_SECONDS <= 1.0
    with pytest.raises(Unauthorized):
        await authenticate(f"Bearer emb_zzzzzzzzzzzz_{'s' * 43}")
    (expiry, _), *_ = authentication.caller_cache.entries.values()
    assert expiry - cache_clock() == authentication.NEGATIVE_CACHE_SECONDS


async def test_cache_is_keyed_by_a_hash_never_the_key(setup):
    await authenticate(f"Bearer {setup.alpha_secret}")

    secret = setup.alpha_secret.split("_", 2)[2]
    for digest in authentication.caller_cache.entries:
        assert secret not in digest and setup.alpha_secret not in digest
        assert len(digest) == 64


async def test_last_used_is_recorded_at_most_once_a_minute(setup, monkeypatch):
    touches: list[int] = []
    touch = authentication.api_key_touch

    def counting(*, api_key_id, **kwargs):
        touches.append(api_key_id)
        return touch(api_key_id=api_key_id, **kwargs)

    monkeypatch.setattr(authentication, "api_key_touch", counting)
    for _ in range(3):
        await authenticate(f"Bearer {setup.alpha_secret}")
    await authenticate(f"Bearer {setup.beta_secret}")

    assert touches == [setup.alpha_key.pk, setup.beta_key.pk]  # no UPDATE for the repeats
    alpha_key = await ApiKey.objects.aget(pk=setup.alpha_key.pk)
    assert alpha_key.last_used_at is not None
    assert timezone.now() - alpha_key.last_used_at < timedelta(seconds=10)


async def test_a_failed_last_used_update_does_not_fail_the_request(setup, monkeypatch, caplog):
    def locked(**kwargs):
        raise OperationalError("database table is locked: embeddings_apikey")

    monkeypatch.setattr(authentication, "api_key_touch", locked)
    caller, _ = await authenticate(f"Bearer {setup.alpha_secret}")

    assert caller.key_id == setup.alpha_key.pk
    assert "could not record the use of API key" in caplog.text


async def test_model_allowed_and_forbidden(setup):
    alpha, _ = await authenticate(f"Bearer {setup.alpha_secret}")
    beta, _ = await authenticate(f"Bearer {setup.beta_secret}")

    ensure_model_allowed(alpha, setup.minilm)
    ensure_model_allowed(alpha, setup.e5)
    ensure_model_allowed(beta, setup.e5)
    with pytest.raises(ModelForbidden) as refused:
        ensure_model_allowed(beta, setup.minilm)
    assert refused.value.status == 403
    assert refused.value.error_code == "model_not_allowed"
    assert refused.value.param == "model"


async def test_allowed_models_follow_the_tenant_after_the_ttl(setup, settings, cache_clock):
    beta, _ = await authenticate(f"Bearer {setup.beta_secret}")
    assert not beta.may_use(setup.minilm)

    await sync_to_async(setup.beta.allowed_models.add)(setup.minilm)
    beta, _ = await authenticate(f"Bearer {setup.beta_secret}")
    assert not beta.may_use(setup.minilm)  # cached
    cache_clock.advance(settings.API_KEY_CACHE_SECONDS + 0.001)
    beta, _ = await authenticate(f"Bearer {setup.beta_secret}")
    assert beta.may_use(setup.minilm)


async def test_deleted_tenant_keys_stop_working(setup, settings):
    settings.API_KEY_CACHE_SECONDS = 0.0
    await sync_to_async(Tenant.objects.filter(pk=setup.alpha.pk).delete)()

    with pytest.raises(Unauthorized):
        await authenticate(f"Bearer {setup.alpha_secret}")
