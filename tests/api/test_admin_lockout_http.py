"""The admin's login lockout (django-axes) through uvicorn on a real socket, as a browser submits the
form (CSRF cookie and token): the admin runs under ASGI here, and the server's two workers must share
one count (axes' database handler). The counting rules are tested in tests/admin/test_login_lockout.py."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import httpx2
import pytest

from tests.admin.test_login_lockout import LOGIN_URL, PASSWORD, WRONG
from tests.processes import manage_commands


@pytest.fixture
def live_admin(uvicorn_server) -> Iterator[tuple[str, str]]:
    """Two superusers, fresh names per test, in the live server's database."""
    names = [f"admin_{secrets.token_hex(4)}", f"other_{secrets.token_hex(4)}"]
    manage_commands(
        {**uvicorn_server.env, "DJANGO_SUPERUSER_PASSWORD": PASSWORD},
        *(
            ("createsuperuser", "--noinput", "--username", name, "--email", f"{name}@example.com")
            for name in names
        ),
    )
    yield names[0], names[1]


def socket_login(
    base_url: str, username: str, password: str, *, source_address: str = "127.0.0.1"
) -> httpx2.Response:
    """The login form as a browser submits it: GET it (CSRF cookie and token), then POST it, from
    `source_address` (any 127/8 address is this machine's loopback)."""
    transport = httpx2.HTTPTransport(local_address=source_address)
    with httpx2.Client(base_url=base_url, transport=transport, timeout=30) as browser:
        form = browser.get(LOGIN_URL)
        assert form.status_code == 200, form.text
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        return browser.post(
            LOGIN_URL,
            data={
                "username": username,
                "password": password,
                "csrfmiddlewaretoken": token,
                "next": "/admin/",
            },
        )


def test_through_uvicorn_the_sixth_attempt_is_refused_even_with_the_right_password(
    uvicorn_server, live_admin
):
    base, (root, other) = uvicorn_server.base_url, live_admin
    failures = [socket_login(base, root, WRONG).status_code for _ in range(5)]
    assert failures == [200] * 4 + [429]
    sixth = socket_login(base, root, PASSWORD)
    assert sixth.status_code == 429
    assert "Too many failed logins" in sixth.text
    assert "sessionid" not in sixth.cookies
    # Another user from the same address, and the same user from another address, log in.
    assert socket_login(base, other, PASSWORD).status_code == 302
    elsewhere = socket_login(base, root, PASSWORD, source_address="127.0.0.2")
    assert elsewhere.status_code == 302 and elsewhere.headers["location"] == "/admin/"
