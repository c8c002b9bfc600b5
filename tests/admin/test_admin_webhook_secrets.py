"""Tenants' webhook secrets: made and rotated by an admin action or `manage.py rotate_webhook_secret`,
shown once, stored encrypted (never the plaintext), signing with an overlap window."""

from __future__ import annotations

import io
import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from embeddings.models import Tenant
from embeddings.services.accounts.encryption import SecretUndecryptable
from embeddings.services.accounts.tenants import (
    tenant_webhook_secret_rotate,
    tenant_webhook_signing_secrets,
    webhook_secret_fingerprint,
)

pytestmark = pytest.mark.django_db

SECRET_PATTERN = re.compile(r"whsec_[A-Za-z0-9_-]{43}")


def stored_columns(tenant: Tenant) -> str:
    return " ".join(str(value) for value in Tenant.objects.filter(pk=tenant.pk).values().get().values())


def test_a_secret_is_random_prefixed_and_stored_only_encrypted(alpha, beta):
    first = tenant_webhook_secret_rotate(tenant=alpha)
    other = tenant_webhook_secret_rotate(tenant=beta)
    assert SECRET_PATTERN.fullmatch(first) and SECRET_PATTERN.fullmatch(other) and first != other
    assert first not in stored_columns(alpha) and first.removeprefix("whsec_") not in stored_columns(alpha)
    assert tenant_webhook_signing_secrets(tenant=Tenant.objects.get(pk=alpha.pk)) == [first]


def test_rotation_overlap_signs_with_both_then_the_new_one_only(alpha):
    old = tenant_webhook_secret_rotate(tenant=alpha)
    now = timezone.now()
    new = tenant_webhook_secret_rotate(tenant=alpha, overlap=timedelta(hours=24), now=now)
    assert tenant_webhook_signing_secrets(tenant=alpha, now=now + timedelta(hours=23)) == [new, old]
    assert tenant_webhook_signing_secrets(tenant=alpha, now=now + timedelta(hours=24)) == [new]
    # A rotation inside the window ends the oldest secret: at most two sign.
    newest = tenant_webhook_secret_rotate(
        tenant=alpha, overlap=timedelta(hours=1), now=now + timedelta(hours=2)
    )
    assert tenant_webhook_signing_secrets(tenant=alpha, now=now + timedelta(hours=2)) == [newest, new]


def test_secrets_survive_a_secret_key_rotation_with_a_fallback_only(alpha, settings):
    secret = tenant_webhook_secret_rotate(tenant=alpha)
    settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]
    settings.SECRET_KEY = "a-new-secret-key-for-this-test"
    assert tenant_webhook_signing_secrets(tenant=alpha) == [secret]
    settings.SECRET_KEY_FALLBACKS = []
    with pytest.raises(SecretUndecryptable):
        tenant_webhook_signing_secrets(tenant=alpha)


def test_the_command_prints_the_secret_once_alone_on_stdout(alpha):
    out, err = io.StringIO(), io.StringIO()
    call_command("rotate_webhook_secret", "--tenant", "alpha", stdout=out, stderr=err)
    first = out.getvalue().strip()
    assert SECRET_PATTERN.fullmatch(first)
    assert "new webhook secret" in err.getvalue() and webhook_secret_fingerprint(first) in err.getvalue()
    assert first not in err.getvalue()

    out, err = io.StringIO(), io.StringIO()
    call_command("rotate_webhook_secret", "--tenant", "alpha", "--overlap-hours", "2", stdout=out, stderr=err)
    second = out.getvalue().strip()
    assert "also signs until" in err.getvalue()
    alpha.refresh_from_db()
    assert tenant_webhook_signing_secrets(tenant=alpha) == [second, first]

    call_command("rotate_webhook_secret", "--tenant", "alpha", "--overlap-hours", "0", stdout=io.StringIO())
    alpha.refresh_from_db()
    assert len(tenant_webhook_signing_secrets(tenant=alpha)) == 1


@pytest.mark.parametrize(
    ("arguments", "message"),
    [(["--tenant", "nobody"], "No tenant"), (["--tenant", "alpha", "--overlap-hours", "-1"], "0 to 720")],
)
def test_the_command_refuses_bad_arguments(alpha, arguments, message):
    with pytest.raises(CommandError, match=message):
        call_command("rotate_webhook_secret", *arguments, stdout=io.StringIO())


def rotate_in_admin(client, action: str, *tenants: Tenant):
    return client.post(
        reverse("admin:embeddings_tenant_changelist"),
        {"action": action, "_selected_action": [tenant.pk for tenant in tenants]},
    )


def test_the_admin_action_shows_each_new_secret_once(admin_client, alpha, beta):
    old = tenant_webhook_secret_rotate(tenant=alpha)
    response = rotate_in_admin(admin_client, "rotate_webhook_secrets", alpha, beta)
    assert response.status_code == 200
    body = response.content.decode()
    secrets = SECRET_PATTERN.findall(body)
    assert len(secrets) == 2 and old not in body
    assert "no-store" in response["Cache-Control"]
    assert not any(secret in morsel.value for secret in secrets for morsel in response.cookies.values())
    alpha.refresh_from_db()
    beta.refresh_from_db()
    alpha_new = tenant_webhook_signing_secrets(tenant=alpha)[0]
    assert set(secrets) == {alpha_new, tenant_webhook_signing_secrets(tenant=beta)[0]}
    assert tenant_webhook_signing_secrets(tenant=alpha) == [alpha_new, old]  # 24 h of overlap

    # The tenant page names them by fingerprint only.
    page = admin_client.get(reverse("admin:embeddings_tenant_change", args=[alpha.pk])).content.decode()
    assert webhook_secret_fingerprint(alpha_new) in page and webhook_secret_fingerprint(old) in page
    assert not SECRET_PATTERN.search(page)


def test_the_admin_rotate_now_action_stops_the_old_secret(admin_client, alpha):
    tenant_webhook_secret_rotate(tenant=alpha)
    response = rotate_in_admin(admin_client, "rotate_webhook_secrets_now", alpha)
    [secret] = SECRET_PATTERN.findall(response.content.decode())
    alpha.refresh_from_db()
    assert tenant_webhook_signing_secrets(tenant=alpha) == [secret]


def test_staff_who_may_only_view_cannot_rotate(client, alpha):
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_tenant"))
    client.force_login(viewer)
    response = rotate_in_admin(client, "rotate_webhook_secrets", alpha)
    assert not SECRET_PATTERN.search(response.content.decode())
    alpha.refresh_from_db()
    assert alpha.webhook_secret_encrypted == ""
