"""Production settings: `manage.py check --deploy` is clean under the environment README.md documents
(read from README itself, so the two cannot drift), bad values stop startup, and behind a
TLS-terminating proxy the admin is HTTPS-only as a real uvicorn serves it."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.api.conftest import LiveServer, live_uvicorn
from tests.processes import REPO_ROOT, run_python

PRODUCTION_BLOCK = re.compile(r"<!-- production-environment -->\s*```sh\n(.*?)```", re.DOTALL)
PUBLIC_HOST = "embeddings.example.com"
ADMIN_PASSWORD = "a-long-password"


def documented_production_environment() -> dict[str, str]:
    """The NAME=value lines of README's production environment block (comments dropped)."""
    match = PRODUCTION_BLOCK.search((REPO_ROOT / "README.md").read_text())
    assert match, "README.md has no <!-- production-environment --> block"
    environment = {}
    for line in match.group(1).splitlines():
        name, separator, value = line.split("#", 1)[0].strip().partition("=")
        if separator:
            environment[name] = value
    return environment


@pytest.fixture
def production_environment(tmp_path: Path) -> dict[str, str]:
    """The documented environment, its secret key file made real, on top of an environment with
    no other DJANGO_ setting."""
    documented = documented_production_environment()
    key_file = tmp_path / "django_secret_key"
    key_file.write_text(secrets.token_urlsafe(64))
    documented["DJANGO_SECRET_KEY_FILE"] = str(key_file)
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("DJANGO_")}
    return {**inherited, **documented, "DJANGO_SETTINGS_MODULE": "embedsite.settings"}


def check_deploy(environment: dict[str, str]) -> subprocess.CompletedProcess:
    return run_python(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], environment)


def test_the_documented_environment_names_the_https_settings():
    documented = documented_production_environment()
    for name in ("DJANGO_DEBUG", "DJANGO_SECRET_KEY_FILE", "DJANGO_ALLOWED_HOSTS", "DJANGO_HTTPS"):
        assert name in documented, name
    assert documented["DJANGO_DEBUG"] in {"0", "false", "off", "no"}


def test_check_deploy_is_clean_under_the_documented_environment(production_environment):
    done = check_deploy(production_environment)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues (0 silenced)" in done.stdout


def test_check_deploy_names_what_plain_http_lacks(production_environment):
    production_environment.pop("DJANGO_HTTPS")
    done = check_deploy(production_environment)
    assert done.returncode != 0
    # HSTS, the https redirect, and the session and CSRF cookies sent only over TLS.
    for check in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert check in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("DJANGO_HTTPS", "sometimes", "DJANGO_HTTPS must be a boolean"),
        (
            "DJANGO_SECURE_PROXY_SSL_HEADER",
            "X-Forwarded-Proto",
            "DJANGO_SECURE_PROXY_SSL_HEADER must be a boolean",
        ),
        ("DJANGO_SECURE_HSTS_SECONDS", "-1", "DJANGO_SECURE_HSTS_SECONDS must be at least 0"),
        ("DJANGO_SECURE_HSTS_SECONDS", "a year", "DJANGO_SECURE_HSTS_SECONDS must be an integer"),
        (
            "DJANGO_CSRF_TRUSTED_ORIGINS",
            f"https://{PUBLIC_HOST},{PUBLIC_HOST}",
            "DJANGO_CSRF_TRUSTED_ORIGINS",
        ),
        ("DJANGO_CSRF_TRUSTED_ORIGINS", "https://", "DJANGO_CSRF_TRUSTED_ORIGINS"),
    ],
)
def test_a_bad_value_stops_startup_naming_it(production_environment, name, value, says):
    done = check_deploy({**production_environment, name: value})
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr and says in done.stderr, done.stderr


@pytest.fixture(scope="module")
def production_server(triton_server, redis_server, tmp_path_factory) -> Iterator[LiveServer]:
    """uvicorn under the documented environment, as behind a proxy that terminates TLS for
    PUBLIC_HOST (loopback is allowed too: the fixture's own readiness probe sends that Host)."""
    documented = documented_production_environment()
    documented.pop("DJANGO_SECRET_KEY_FILE")
    environment = {
        **documented,
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(64),
        "DJANGO_ALLOWED_HOSTS": f"{documented['DJANGO_ALLOWED_HOSTS']},127.0.0.1",
    }
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("production_server"),
        triton_target=triton_server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        env=environment,
        setup=[("createsuperuser", "--noinput", "--username", "root", "--email", "root@example.com")],
        setup_env={"DJANGO_SUPERUSER_PASSWORD": ADMIN_PASSWORD},
    ) as server:
        yield server


def through_the_proxy(server: LiveServer, **headers: str) -> httpx2.Client:
    """A client as the proxy forwards it: Host the public name, X-Forwarded-Proto as given."""
    return httpx2.Client(
        base_url=server.base_url, headers={"Host": PUBLIC_HOST, **headers}, timeout=30, follow_redirects=False
    )


def test_plain_http_to_the_admin_is_sent_to_https(production_server):
    with through_the_proxy(production_server, **{"X-Forwarded-Proto": "http"}) as client:
        response = client.get("/admin/login/")
    assert response.status_code == 301
    assert response.headers["location"] == f"https://{PUBLIC_HOST}/admin/login/"


def test_the_api_is_not_redirected(production_server):
    # Probes and in-cluster clients speak plain http to the pod.
    with through_the_proxy(production_server) as client:
        assert client.get("/health").status_code == 200


def test_https_through_the_proxy_gets_hsts_and_secure_cookies_and_logs_in(production_server):
    with through_the_proxy(production_server, **{"X-Forwarded-Proto": "https"}) as client:
        page = client.get("/admin/login/")
        assert page.status_code == 200
        assert page.headers["strict-transport-security"] == "max-age=31536000; includeSubDomains; preload"
        assert "secure" in page.headers["set-cookie"].lower()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        form = {"csrfmiddlewaretoken": token, "username": "root", "password": ADMIN_PASSWORD}
        # Sent by hand: a client keeps a Secure cookie off the plain-http hop behind the proxy.
        client.headers["Cookie"] = f"csrftoken={page.cookies['csrftoken']}"
        # A page of another origin posting the form is refused, the public origin logs in.
        foreign = client.post(
            "/admin/login/?next=/admin/", data=form, headers={"Origin": "https://elsewhere.example.org"}
        )
        assert foreign.status_code == 403
        logged_in = client.post(
            "/admin/login/?next=/admin/", data=form, headers={"Origin": f"https://{PUBLIC_HOST}"}
        )
        assert logged_in.status_code == 302 and logged_in.headers["location"] == "/admin/"
        session_cookie = next(
            value
            for name, value in logged_in.headers.multi_items()
            if name == "set-cookie" and "sessionid" in value
        )
        assert "secure" in session_cookie.lower() and "httponly" in session_cookie.lower()
