"""Settings read from the environment: seed variable names, loud failures on bad values, and the
secret key (required and strong outside DEBUG, from the environment or a file)."""

import importlib.util
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from embedsite.settings import (
    DEBUG_ONLY_SECRET_KEY,
    database_from_url,
    env_bool,
    env_int,
    env_networks,
    secret_weakness,
    triton_grpc_target,
)
from tests.processes import REPO_ROOT, run_python


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("localhost", "localhost:8001"),
        ("triton:9001", "triton:9001"),
        ("http://triton", "triton:8001"),
        ("grpc://10.0.0.5:7001", "10.0.0.5:7001"),
        ("[::1]:8001", "[::1]:8001"),
        # Replicas: a list of addresses, or one name that resolves to each of them.
        ("10.0.0.5:7001, 10.0.0.6", "ipv4:10.0.0.5:7001,10.0.0.6:8001"),
        ("[fd00::5]:7001,[fd00::6]:7001", "ipv6:[fd00::5]:7001,[fd00::6]:7001"),
        ("dns:///triton-headless:7001", "dns:///triton-headless:7001"),
        ("dns:triton", "dns:///triton:8001"),
    ],
)
def test_triton_url_forms_of_the_seed_proxy_and_of_replicas(url, target):
    assert triton_grpc_target(url, 8001) == target


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("triton:notaport", "bad port"),
        ("triton-a:8001,triton-b:8001", "one DNS name that resolves to every replica"),
        ("10.0.0.5,[fd00::6]", "all IPv4 or all IPv6"),
        ("10.0.0.5,10.0.0.5:8001", "listed twice"),
        (" , ", "empty"),
    ],
)
def test_a_bad_triton_url_fails_loudly_saying_why(url, why):
    with pytest.raises(ImproperlyConfigured, match=why):
        triton_grpc_target(url, 8001)


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
        5433,
        "embed",
    )
    assert (config["CONN_MAX_AGE"], config["CONN_HEALTH_CHECKS"]) == (0, False)
    assert database_from_url("sqlite:////tmp/x.db")["NAME"] == "/tmp/x.db"


def test_database_url_keeps_query_options_and_connection_settings():
    """Query options reach the driver (libpq's sslmode, a CA file, connect_timeout): the old
    hand-written parser dropped them, so `?sslmode=require` silently connected without TLS."""
    config = database_from_url(
        "postgresql://app@db.internal/embedsite?sslmode=verify-full&sslrootcert=/ca.pem&connect_timeout=5",
        conn_max_age=60,
        conn_health_checks=True,
    )
    assert config["OPTIONS"] == {"sslmode": "verify-full", "sslrootcert": "/ca.pem", "connect_timeout": 5}
    assert (config["CONN_MAX_AGE"], config["CONN_HEALTH_CHECKS"]) == (60, True)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://x/y", "scheme 'mysql' is not supported"),
        ("db.example:5432/embedsite", "scheme '' is not supported"),
        ("postgres://u@db:5432/", "needs a database name"),
        ("postgres://u@db:notaport/embed", "cannot be read"),
    ],
)
def test_database_url_refuses_what_it_cannot_serve(url, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        database_from_url(url)


def test_database_settings_from_the_environment(project_copy: Path):
    """DATABASE_URL, DATABASE_CONN_MAX_AGE and DATABASE_CONN_HEALTH_CHECKS as settings load them,
    and a bad value refused at startup."""
    code = (
        "import django; django.setup(); from django.conf import settings; import json; "
        "print(json.dumps(settings.DATABASES['default'], default=str))"
    )
    done = load_settings(
        project_copy,
        code,
        DJANGO_DEBUG="1",
        DATABASE_URL="postgres://app:pw@127.0.0.1:6543/site?sslmode=require",
        DATABASE_CONN_MAX_AGE="30",
        DATABASE_CONN_HEALTH_CHECKS="true",
    )
    assert done.returncode == 0, done.stderr
    database = json.loads(done.stdout.splitlines()[-1])
    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert database["OPTIONS"] == {"sslmode": "require"}
    assert (database["CONN_MAX_AGE"], database["CONN_HEALTH_CHECKS"]) == (30, True)
    refused = load_settings(project_copy, code, DJANGO_DEBUG="1", DATABASE_CONN_MAX_AGE="-1")
    assert refused.returncode != 0
    assert "DATABASE_CONN_MAX_AGE must be at least 0" in refused.stderr


# --- The secret key: refused when missing or weak outside DEBUG ----------------------------------

STRONG_KEY = "k3y-" + "0123456789abcdefghijklmnopqrstuvwxyz"
SECRET_VARIABLES = (
    "DJANGO_SECRET_KEY",
    "DJANGO_SECRET_KEY_FILE",
    "DJANGO_SECRET_KEY_FALLBACKS",
    "API_KEY_HMAC_SECRET",
    "DJANGO_DEBUG",
)
PRINT_SECRETS = (
    "import django; django.setup(); from django.conf import settings; "
    "print(settings.SECRET_KEY); print(settings.API_KEY_HMAC_SECRET)"
)


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """The `embedsite` package copied under tmp_path, so its BASE_DIR (and BASE_DIR/.run/secret_key)
    is a directory this test controls; `embeddings` is still imported from the checkout."""
    shutil.copytree(
        REPO_ROOT / "embedsite", tmp_path / "embedsite", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


def load_settings(
    project: Path, code: str = PRINT_SECRETS, **environment: str
) -> subprocess.CompletedProcess:
    """`django.setup()` (then `code`) in a Python of its own (forked: tests/forkserver.py gives it
    PYTHONPATH as a fresh interpreter would have it) with only `environment` as secret settings."""
    env = {name: value for name, value in os.environ.items() if name not in SECRET_VARIABLES}
    env.update(
        environment,
        DJANGO_SETTINGS_MODULE="embedsite.settings",
        PYTHONPATH=os.pathsep.join([str(project), str(REPO_ROOT)]),
    )
    return run_python(["-c", code], env, cwd=project)


def loaded_secrets(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def refusal(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0, f"settings loaded: {done.stdout}"
    assert "ImproperlyConfigured" in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def test_settings_refuse_to_load_without_a_secret_key(project_copy):
    message = refusal(load_settings(project_copy))
    assert "No secret key: set DJANGO_SECRET_KEY, or DJANGO_SECRET_KEY_FILE" in message
    assert str(project_copy / ".run" / "secret_key") in message


def test_debug_runs_on_the_public_key_without_one(project_copy):
    assert loaded_secrets(load_settings(project_copy, DJANGO_DEBUG="true")) == [DEBUG_ONLY_SECRET_KEY] * 2


def test_the_key_from_the_environment_also_keys_api_key_hashes(project_copy):
    assert loaded_secrets(load_settings(project_copy, DJANGO_SECRET_KEY=STRONG_KEY)) == [STRONG_KEY] * 2


def test_the_key_from_a_named_file(project_copy, tmp_path):
    key_file = tmp_path / "mounted-secret"
    key_file.write_text(STRONG_KEY + "\n")  # secrets files often end in a newline
    done = load_settings(project_copy, DJANGO_SECRET_KEY_FILE=str(key_file))
    assert loaded_secrets(done) == [STRONG_KEY] * 2


def test_a_named_file_that_is_missing_is_refused_by_name(project_copy, tmp_path):
    missing = tmp_path / "nowhere" / "secret"
    message = refusal(load_settings(project_copy, DJANGO_SECRET_KEY_FILE=str(missing)))
    assert f"DJANGO_SECRET_KEY_FILE ({missing}) cannot be read" in message


def test_the_environment_wins_over_the_file(project_copy, tmp_path):
    (project_copy / ".run").mkdir()
    (project_copy / ".run" / "secret_key").write_text("f" + STRONG_KEY)
    assert loaded_secrets(load_settings(project_copy, DJANGO_SECRET_KEY=STRONG_KEY))[0] == STRONG_KEY


@pytest.mark.parametrize(
    ("weak", "reason"),
    [
        (DEBUG_ONLY_SECRET_KEY, "public debug-only key"),
        ("s3cr3t-but-only-31-characters!!", "31 characters, fewer than 32"),
        ("django-insecure-" + "x1y2z3" * 8, "django-insecure"),
        ("ab" * 40, "fewer than 5 different characters"),
    ],
)
def test_weak_keys_are_refused_outside_debug(project_copy, weak, reason):
    message = refusal(load_settings(project_copy, DJANGO_SECRET_KEY=weak))
    assert "DJANGO_SECRET_KEY is not a usable secret" in message
    assert reason in message


def test_a_weak_key_in_a_file_is_refused_and_debug_accepts_it(project_copy, tmp_path):
    key_file = tmp_path / "secret"
    key_file.write_text("short")
    assert "5 characters, fewer than 32" in refusal(
        load_settings(project_copy, DJANGO_SECRET_KEY_FILE=str(key_file))
    )
    done = load_settings(project_copy, DJANGO_SECRET_KEY_FILE=str(key_file), DJANGO_DEBUG="1")
    assert loaded_secrets(done)[0] == "short"


def test_a_separate_api_key_hmac_secret_is_validated_the_same_way(project_copy):
    done = load_settings(project_copy, DJANGO_SECRET_KEY=STRONG_KEY, API_KEY_HMAC_SECRET="weak")
    assert "API_KEY_HMAC_SECRET is not a usable secret" in refusal(done)
    other = STRONG_KEY[::-1]
    done = load_settings(project_copy, DJANGO_SECRET_KEY=STRONG_KEY, API_KEY_HMAC_SECRET=other)
    assert loaded_secrets(done) == [STRONG_KEY, other]


def test_earlier_keys_are_fallbacks_and_checked_as_the_key(project_copy):
    earlier = STRONG_KEY[::-1]
    print_fallbacks = (
        "import django; django.setup(); from django.conf import settings; "
        "print(*settings.SECRET_KEY_FALLBACKS, sep='\\n')"
    )
    done = load_settings(
        project_copy,
        print_fallbacks,
        DJANGO_SECRET_KEY=STRONG_KEY,
        DJANGO_SECRET_KEY_FALLBACKS=f"{earlier}, {earlier}x",
    )
    assert loaded_secrets(done) == [earlier, earlier + "x"]
    done = load_settings(project_copy, DJANGO_SECRET_KEY=STRONG_KEY, DJANGO_SECRET_KEY_FALLBACKS="short")
    assert "DJANGO_SECRET_KEY_FALLBACKS is not a usable secret" in refusal(done)


def test_setup_writes_a_private_random_key_once_and_settings_read_it(project_copy):
    """`make .run/secret_key` (a prerequisite of `make setup`) in a fresh directory: mode 0600, 50+
    characters, the same file after a second run, and settings loaded there find it unaided."""

    def make_secret() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["make", "--no-print-directory", "-f", str(REPO_ROOT / "Makefile"), "-C", str(project_copy),
             ".run/secret_key"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    key_file = project_copy / ".run" / "secret_key"
    assert make_secret().returncode == 0
    key = key_file.read_text()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(key) >= 50 and secret_weakness(key) is None
    second = make_secret()
    assert second.returncode == 0 and "up to date" in second.stdout
    assert key_file.read_text() == key
    assert loaded_secrets(load_settings(project_copy)) == [key] * 2


def test_make_setup_creates_the_key_before_any_manage_py_command():
    """Every setup step that runs manage.py (export, migrate, register) waits for the secret key."""
    plan = subprocess.run(
        ["make", "-f", str(REPO_ROOT / "Makefile"), "-p", "-n", "--no-print-directory", "-q", "setup-steps"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    rules = {
        line.split(":", 1)[0]: line for line in plan.splitlines() if ":" in line and not line.startswith("#")
    }
    manage_py_steps = (".run/.migrated", ".run/.registered", "model_repository/minilm/1/model.onnx")
    for target in ("setup-steps", *manage_py_steps):
        assert ".run/secret_key" in rules[target], rules[target]


def test_processes_make_starts_write_bytecode_where_the_environment_says_not_to():
    """Where PYTHONDONTWRITEBYTECODE is set (CI sets it) Python writes no bytecode, and every process
    the tests start compiled each module it imports, at each start. The Makefile's processes write it:
    one importing gRPC leaves gRPC's bytecode, matching its source."""
    probe = (
        "import importlib.util, sys, grpc; "
        "print(sys.dont_write_bytecode, importlib.util.cache_from_source(grpc.__file__))"
    )
    done = subprocess.run(
        ["make", "--no-print-directory", "-s", "-f", str(REPO_ROOT / "Makefile"),
         "--eval", f"bytecode-probe: ; @$(PY) -c '{probe}'", "bytecode-probe"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    dont_write, cached = done.stdout.split()
    assert dont_write == "False"
    header = Path(cached).read_bytes()[:16]
    # A timestamp-checked .pyc: magic, flags 0, then the source's mtime it was made from.
    source = Path(cached).parent.parent / "__init__.py"
    assert header[:4] == importlib.util.MAGIC_NUMBER and header[4:8] == bytes(4)
    assert int.from_bytes(header[8:12], "little") == int(source.stat().st_mtime) & 0xFFFFFFFF


def test_admin_lockout_settings_from_the_environment(project_copy):
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "print(settings.AXES_FAILURE_LIMIT, settings.AXES_COOLOFF_TIME.total_seconds())"
    )
    environment = {"DJANGO_SECRET_KEY": STRONG_KEY}
    done = load_settings(
        project_copy, code, ADMIN_LOGIN_FAILURE_LIMIT="3", ADMIN_LOGIN_COOLOFF_MINUTES="0.5", **environment
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "30.0"]
    refused = load_settings(project_copy, code, ADMIN_LOGIN_FAILURE_LIMIT="0", **environment)
    assert "ADMIN_LOGIN_FAILURE_LIMIT must be at least 1" in refusal(refused)


def test_local_triton_model_control_from_the_environment(project_copy):
    code = (
        "import django; django.setup(); from embeddings.tooling.local_triton import local_triton_server; "
        "from django.conf import settings; server = local_triton_server(); "
        "print(server.model_control_mode, ','.join(server.startup_models) or '-', "
        "settings.TRITON_MODEL_LOAD_TIMEOUT_S)"
    )
    environment = {"DJANGO_SECRET_KEY": STRONG_KEY}
    default = load_settings(project_copy, code, **environment)
    assert default.returncode == 0, default.stderr
    assert default.stdout.split() == ["explicit", "minilm,minilm_tokenizer,minilm_text", "300.0"]
    chosen = load_settings(
        project_copy,
        code,
        TRITON_STARTUP_MODELS="minilm_text",
        TRITON_MODEL_LOAD_TIMEOUT_S="20",
        **environment,
    )
    assert chosen.stdout.split() == ["explicit", "minilm_text", "20.0"], chosen.stderr
    # Mode none loads every folder at start: no --load-model to give.
    everything = load_settings(project_copy, code, TRITON_MODEL_CONTROL_MODE="none", **environment)
    assert everything.stdout.split() == ["none", "-", "300.0"], everything.stderr
    refused = load_settings(project_copy, code, TRITON_MODEL_CONTROL_MODE="Explicit", **environment)
    assert "TRITON_MODEL_CONTROL_MODE must be explicit, none or poll, got 'Explicit'" in refusal(refused)


@pytest.mark.parametrize(
    ("environment", "refused"),
    [
        ({}, True),  # one Redis for everything
        ({"JOB_STORE_URL": "redis://127.0.0.1:6390/3"}, True),  # another database, the same server
        ({"EMBEDDING_CACHE_REDIS_URL": "redis://localhost:6390/7"}, True),
        ({"JOB_STORE_URL": "redis://127.0.0.1:6391/0"}, False),  # the job store's own server
        ({"EMBEDDING_CACHE_REDIS_URL": "redis://cache:6379/0"}, False),
    ],
)
def test_the_cache_is_refused_a_place_on_the_critical_redis(project_copy, environment, refused):
    done = load_settings(
        project_copy,
        DJANGO_DEBUG="true",
        EMBEDDING_CACHE="true",
        **{
            "REDIS_URL": "redis://127.0.0.1:6390/0",
            "JOB_STORE_URL": "",
            "EMBEDDING_CACHE_REDIS_URL": "",
            **environment,
        },
    )
    if refused:
        assert "its Redis would be the critical one" in refusal(done)
    else:
        assert done.returncode == 0, done.stderr
