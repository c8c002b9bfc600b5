"""Admin login brute force (django-axes), through Django's test client: failures counted per
username and client address, a 429 lockout page once the limit is reached (even for the right
password), a cool-off, a reset on success. Through uvicorn on a socket:
tests/api/test_admin_lockout_http.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

LOGIN_URL = "/admin/login/"
PASSWORD = "correct horse battery staple"
WRONG = "wrong password"


def post_login(client: Client, username: str, password: str, **extra) -> int:
    return client.post(
        LOGIN_URL, {"username": username, "password": password, "next": "/admin/"}, **extra
    ).status_code


@pytest.fixture
def admin_user_with_password(db) -> User:
    return User.objects.create_superuser("root", "root@example.com", PASSWORD)


def test_the_defaults_are_five_failures_and_fifteen_minutes():
    assert django_settings.AXES_FAILURE_LIMIT == 5
    assert django_settings.AXES_COOLOFF_TIME.total_seconds() == 15 * 60


def test_the_api_middleware_stack_has_no_axes():
    assert not [name for name in django_settings.API_MIDDLEWARE if "axes" in name]
    assert "axes.middleware.AxesMiddleware" in django_settings.MIDDLEWARE


def test_the_fifth_failure_locks_out_even_the_right_password(admin_user_with_password):
    client = Client()
    assert [post_login(client, "root", WRONG) for _ in range(4)] == [200] * 4
    locked = client.post(LOGIN_URL, {"username": "root", "password": WRONG})
    assert locked.status_code == 429
    assert locked["Retry-After"] == "900"
    assert b"Too many failed logins: 5 in a row" in locked.content
    assert post_login(client, "root", PASSWORD) == 429
    assert client.get("/admin/").status_code == 302  # still not logged in: sent to the login page


def test_other_users_and_other_addresses_are_not_locked(admin_user_with_password):
    User.objects.create_superuser("second", "second@example.com", PASSWORD)
    attacker = Client()
    assert [post_login(attacker, "root", WRONG) for _ in range(5)] == [200] * 4 + [429]
    # Same address, another username: its own count.
    assert post_login(Client(), "second", PASSWORD) == 302
    # Same username from another address: the real admin elsewhere still logs in.
    assert post_login(Client(), "root", PASSWORD, REMOTE_ADDR="192.0.2.10") == 302


def test_a_success_resets_the_count(admin_user_with_password):
    client = Client()
    assert [post_login(client, "root", WRONG) for _ in range(4)] == [200] * 4
    assert post_login(client, "root", PASSWORD) == 302
    client.logout()
    # Four more failures are allowed again: the count started over.
    assert [post_login(client, "root", WRONG) for _ in range(4)] == [200] * 4
    assert post_login(client, "root", WRONG) == 429


def test_the_lockout_ends_after_the_cool_off(admin_user_with_password):
    client = Client()
    assert [post_login(client, "root", WRONG) for _ in range(5)][-1] == 429
    assert post_login(client, "root", PASSWORD) == 429
    # As if the cool-off had passed since the last attempt (no sleeping in tests).
    AccessAttempt.objects.update(
        attempt_time=timezone.now() - django_settings.AXES_COOLOFF_TIME - timedelta(seconds=1)
    )
    assert post_login(client, "root", PASSWORD) == 302


def test_the_limit_follows_the_setting(admin_user_with_password, settings):
    settings.AXES_FAILURE_LIMIT = 2
    assert [post_login(Client(), "root", WRONG) for _ in range(2)] == [200, 429]
