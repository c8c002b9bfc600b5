"""Settings read from the environment: seed variable names and loud failures on bad values."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from embedsite.settings import database_from_url, env_bool, env_int, env_networks, triton_grpc_target


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("localhost", "localhost:8001"),
        ("triton:9001", "triton:9001"),
        ("http://triton", "triton:8001"),
        ("grpc://10.0.0.5:7001", "10.0.0.5:7001"),
        ("[::1]:8001", "[::1]:8001"),
    ],
)
def test_triton_url_forms_of_the_seed_proxy(url, target):
    assert triton_grpc_target(url, 8001) == target


def test_triton_url_with_bad_port_fails_loudly():
    with pytest.raises(ImproperlyConfigured):
        triton_grpc_target("triton:notaport", 8001)


def test_env_int_rejects_garbage_and_out_of_range(monkeypatch):
    monkeypatch.setenv("X_PORT", "80a")
    with pytest.raises(ImproperlyConfigured, match="X_PORT"):
        env_int("X_PORT", 1)
    monkeypatch.setenv("X_PORT", "0")
    with pytest.raises(ImproperlyConfigured):
        env_int("X_PORT", 1, minimum=1)
    monkeypatch.setenv("X_PORT", "")
    assert env_int("X_PORT", 7) == 7


def test_env_bool(monkeypatch):
    monkeypatch.setenv("FLAG", "yes")
    assert env_bool("FLAG", False) is True
    monkeypatch.setenv("FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured):
        env_bool("FLAG", False)


def test_env_networks(monkeypatch):
    monkeypatch.setenv("NETS", " 10.0.0.0/8, 127.0.0.1/32,::1/128 ")
    assert env_networks("NETS") == ("10.0.0.0/8", "127.0.0.1/32", "::1/128")
    monkeypatch.setenv("NETS", "")
    assert env_networks("NETS") == ()
    for bad in ("127.0.0.1/8", "10.0.0.0/33", "localhost"):
        monkeypatch.setenv("NETS", bad)
        with pytest.raises(ImproperlyConfigured, match="NETS"):
            env_networks("NETS")


def test_database_url():
    config = database_from_url("postgres://u:p%40ss@db:5433/embed")
    assert config["ENGINE"] == "django.db.backends.postgresql"
    assert (config["USER"], config["PASSWORD"], config["HOST"], config["PORT"], config["NAME"]) == (
        "u",
        "p@ss",
        "db",
        "5433",
        "embed",
    )
    assert database_from_url("sqlite:////tmp/x.db")["NAME"] == "/tmp/x.db"
    with pytest.raises(ImproperlyConfigured):
        database_from_url("mysql://x/y")
