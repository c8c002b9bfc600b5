"""API key services: format, hash-only storage, lookup, revocation, expiry, isolation, last use."""

from __future__ import annotations

import hashlib
import hmac
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from embeddings.models import ApiKey
from embeddings.services.keys import (
    api_key_create,
    api_key_for_secret,
    api_key_revoke,
    api_key_touch,
    parse_api_key,
)
from embeddings.services.tenants import tenant_create

FULL_KEY = re.compile(r"^emb_(?P<public_id>[a-z0-9]{12})_(?P<secret>[A-Za-z0-9_-]{43})$")


@pytest.fixture
def alpha(db):
    return tenant_create(name="Alpha")


@pytest.fixture
def beta(db):
    return tenant_create(name="Beta")


def test_key_format_is_prefix_public_id_secret(alpha):
    api_key, full_key = api_key_create(tenant=alpha, name="ci")

    match = FULL_KEY.match(full_key)
    assert match, full_key
    assert match["public_id"] == api_key.public_id
    assert parse_api_key(full_key) == (api_key.public_id, match["secret"])
    assert api_key.prefix == f"emb_{api_key.public_id}_"
    assert full_key.startswith(api_key.prefix)


def test_parsing_is_unambiguous_when_the_secret_contains_underscores(alpha):
    # token_urlsafe may put "_" in the secret; the split is after the fixed-length public id.
    assert parse_api_key("emb_abcdefghij12_se_cr_et_with_underscores__") == (
        "abcdefghij12",
        "se_cr_et_with_underscores__",
    )


def test_keys_are_distinct(alpha):
    created = [api_key_create(tenant=alpha, name=f"k{i}") for i in range(20)]
    assert len({key.public_id for key, _ in created}) == 20
    assert len({full for _, full in created}) == 20


def test_only_an_hmac_of_the_secret_is_stored(alpha, settings):
    api_key, full_key = api_key_create(tenant=alpha, name="ci")
    secret = parse_api_key(full_key)[1]

    row = ApiKey.objects.filter(pk=api_key.pk).values().get()
    stored = " ".join(str(value) for value in row.values())
    assert secret not in stored
    assert full_key not in stored
    expected = hmac.new(settings.API_KEY_HMAC_SECRET.encode(), secret.encode(), hashlib.sha256).hexdigest()
    assert row["secret_hash"] == expected
    assert row["secret_hash"] != hashlib.sha256(secret.encode()).hexdigest()  # keyed, not a bare hash


def test_changing_the_hmac_secret_invalidates_keys(alpha, settings):
    _, full_key = api_key_create(tenant=alpha, name="ci")
    settings.API_KEY_HMAC_SECRET = "rotated"
    assert api_key_for_secret(key=full_key) is None


def test_lookup_returns_the_key_with_its_tenant(alpha, django_assert_num_queries):
    api_key, full_key = api_key_create(tenant=alpha, name="ci")

    with django_assert_num_queries(1):  # key and tenant in one query
        found = api_key_for_secret(key=full_key)
        assert found.tenant.slug == "alpha"
    assert found.pk == api_key.pk


def test_wrong_secret_is_refused(alpha):
    api_key, full_key = api_key_create(tenant=alpha, name="ci")
    secret = parse_api_key(full_key)[1]
    wrong = secret[:-1] + ("A" if secret[-1] != "A" else "B")

    assert api_key_for_secret(key=f"emb_{api_key.public_id}_{wrong}") is None


def test_unknown_public_id_is_refused(alpha):
    _, full_key = api_key_create(tenant=alpha, name="ci")
    secret = parse_api_key(full_key)[1]

    assert api_key_for_secret(key=f"emb_zzzzzzzzzzzz_{secret}") is None


@pytest.mark.parametrize(
    "key",
    [
        "",
        "emb_",
        "emb__",
        "Bearer emb_abcdefghij12_" + "s" * 43,
        "sk-" + "a" * 48,
        "emb_abcdefghij12_short",
        "emb_ABCDEFGHIJ12_" + "s" * 43,  # public ids are lower case
        "emb_abcdefghij1_" + "s" * 43,  # 11 characters
        "emb_abcdefghij123_" + "s" * 43,  # 13 characters
        "emb_abcdefghij12_" + "s" * 43 + " ",
        "emb_abcdefghij12_" + "s" * 43 + "\n",
        "emb_abcdefghij12_" + "s" * 42 + "é",
        "emb_abcdefghij12_" + "s" * 500,
    ],
)
def test_malformed_keys_are_refused(alpha, key, django_assert_num_queries):
    assert parse_api_key(key) is None
    with django_assert_num_queries(0):
        assert api_key_for_secret(key=key) is None


def test_a_tenants_key_never_resolves_to_another_tenant(alpha, beta):
    alpha_key, alpha_full = api_key_create(tenant=alpha, name="a")
    beta_key, beta_full = api_key_create(tenant=beta, name="b")

    assert api_key_for_secret(key=alpha_full).tenant == alpha
    assert api_key_for_secret(key=beta_full).tenant == beta
    # Beta's secret under alpha's public id (and the reverse) matches nothing.
    alpha_secret, beta_secret = parse_api_key(alpha_full)[1], parse_api_key(beta_full)[1]
    assert api_key_for_secret(key=f"emb_{alpha_key.public_id}_{beta_secret}") is None
    assert api_key_for_secret(key=f"emb_{beta_key.public_id}_{alpha_secret}") is None


def test_revoke_marks_the_key_once(alpha):
    api_key, full_key = api_key_create(tenant=alpha, name="ci")
    first = timezone.now()

    api_key_revoke(api_key=api_key, now=first)
    api_key_revoke(api_key=api_key, now=first + timedelta(hours=1))

    api_key.refresh_from_db()
    assert api_key.revoked_at == first
    found = api_key_for_secret(key=full_key)  # still found, so the caller can say "revoked"
    assert found is not None and found.is_revoked()


def test_expiry(alpha):
    now = timezone.now()
    api_key, full_key = api_key_create(tenant=alpha, name="ci", expires_at=now + timedelta(days=1))

    assert not api_key.is_expired(now)
    assert not api_key.is_expired(now + timedelta(hours=23))
    assert api_key.is_expired(now + timedelta(days=1))
    assert api_key_for_secret(key=full_key).is_expired(now + timedelta(days=2))
    never, _ = api_key_create(tenant=alpha, name="forever")
    assert not never.is_expired(now + timedelta(days=36500))
    assert not never.is_revoked()


def test_touch_updates_last_used_at_most_once_a_minute(alpha, django_assert_num_queries):
    api_key, _ = api_key_create(tenant=alpha, name="ci")
    now = timezone.now()

    assert api_key_touch(api_key_id=api_key.pk, now=now) is True
    with django_assert_num_queries(1):  # one conditional UPDATE, no read
        assert api_key_touch(api_key_id=api_key.pk, now=now + timedelta(seconds=30)) is False
    api_key.refresh_from_db()
    assert api_key.last_used_at == now

    assert api_key_touch(api_key_id=api_key.pk, now=now + timedelta(seconds=61)) is True
    api_key.refresh_from_db()
    assert api_key.last_used_at == now + timedelta(seconds=61)


def test_touch_leaves_other_keys_alone(alpha, beta):
    alpha_key, _ = api_key_create(tenant=alpha, name="a")
    beta_key, _ = api_key_create(tenant=beta, name="b")

    api_key_touch(api_key_id=alpha_key.pk, now=timezone.now())

    beta_key.refresh_from_db()
    assert beta_key.last_used_at is None
