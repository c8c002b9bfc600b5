"""API key services: format, hash-only storage, lookup, revocation, expiry, isolation, last use."""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from embeddings.models import ApiKey
from embeddings.services.accounts import api_keys as keys
from embeddings.services.accounts.api_keys import (
    api_key_create,
    api_key_for_secret,
    api_key_revoke,
    api_key_touch,
    parse_api_key,
)
from embeddings.services.accounts.tenants import tenant_create
from tests.database_backend import wait_for_lock_waiters

FULL_KEY = re.compile(r"^emb_(?P<public_id>[a-z0-9]{12})_(?P<secret>[A-Za-z0-9_-]{43})$")


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


@pytest.fixture
def public_ids(monkeypatch):
    """The public ids api_key_create draws, in order: a test makes them collide."""
    queue: list[str] = []
    monkeypatch.setattr(keys, "new_public_id", lambda: queue.pop(0))
    return queue


def test_a_taken_public_id_is_drawn_again_inside_the_callers_transaction(alpha, public_ids):
    """The admin creates keys inside its own transaction: a collision must not break it (on
    PostgreSQL a failed INSERT outside a savepoint aborts the whole transaction)."""
    public_ids.extend(["takenid00001", "takenid00001", "freshid00002"])
    api_key_create(tenant=alpha, name="first")
    with transaction.atomic():
        second, full_key = api_key_create(tenant=alpha, name="second")
        assert ApiKey.objects.filter(tenant=alpha).count() == 2
    assert second.public_id == "freshid00002" and full_key.startswith("emb_freshid00002_")
    assert api_key_for_secret(key=full_key) == second


def test_a_public_id_that_keeps_colliding_is_an_error_not_a_loop(alpha, public_ids):
    public_ids.extend(["takenid00001"] * (1 + keys.PUBLIC_ID_ATTEMPTS))
    api_key_create(tenant=alpha, name="first")
    with pytest.raises(IntegrityError):
        api_key_create(tenant=alpha, name="second")
    assert public_ids == []


def test_two_creations_racing_for_one_public_id_both_get_a_key(transactional_db, public_ids, postgresql_only):
    """Creation B draws the public id that creation A has inserted but not committed: B's INSERT
    waits for A, then fails on the unique id (a look-up first would have found nothing), and B
    draws again instead of failing."""
    tenant = tenant_create(name="Racing")
    public_ids.extend(["racingid0001", "racingid0002"])
    outcome: list = []

    def create_b():
        from django.db import connection

        try:
            outcome.append(api_key_create(tenant=tenant, name="b"))
        except Exception as error:
            outcome.append(error)
        finally:
            connection.close()

    creation_b = threading.Thread(target=create_b)
    with transaction.atomic():
        key_a = ApiKey.objects.create(tenant=tenant, name="a", public_id="racingid0001", secret_hash="x")
        creation_b.start()
        wait_for_lock_waiters(1)
    creation_b.join(timeout=60)
    [(key_b, full_key)] = outcome
    assert key_b.public_id == "racingid0002" and key_a.public_id == "racingid0001"
    assert api_key_for_secret(key=full_key) == key_b
