"""Settings, read from the environment with safe local defaults; a bad value fails loudly at startup."""

import ipaddress
import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from whitenoise.compress import Compressor

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), got {raw!r}")


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_networks(name: str) -> tuple[str, ...]:
    """Comma-separated CIDRs; one with host bits set ("10.0.0.1/8") is refused, not guessed at."""
    networks = tuple(env_list(name, []))
    for network in networks:
        try:
            ipaddress.ip_network(network, strict=True)
        except ValueError as error:
            raise ImproperlyConfigured(f"{name}: {error}") from None
    return networks


# The drivers installed (psycopg 3, the stdlib's sqlite3): other schemes dj-database-url knows would
# fail later, at the first query, with a less useful message.
DATABASE_SCHEMES = {"postgres", "postgresql", "pgsql", "sqlite"}


def database_from_url(url: str, *, conn_max_age: int = 0, conn_health_checks: bool = False) -> dict:
    """`postgres://user:password@host:port/name?sslmode=require` (query options go to the driver) or
    `sqlite:///path`, in Django's format (dj-database-url)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in DATABASE_SCHEMES:
        raise ImproperlyConfigured(
            f"DATABASE_URL scheme {scheme!r} is not supported ({', '.join(sorted(DATABASE_SCHEMES))})"
        )
    try:
        config = dj_database_url.parse(url, conn_max_age=conn_max_age, conn_health_checks=conn_health_checks)
    except ValueError as error:
        raise ImproperlyConfigured(f"DATABASE_URL cannot be read: {error}") from None
    if config["ENGINE"] != "django.db.backends.sqlite3" and not config.get("NAME"):
        raise ImproperlyConfigured("DATABASE_URL needs a database name")
    return config


def triton_grpc_target(url: str, default_port: int) -> str:
    """The target gRPC dials for TRITON_SERVER_URL: the seed proxy's `host`, `host:port` or
    `http://host[:port]`, `dns:///name:port`, or a list of IP replicas (embeddings/triton/targets.py)."""
    from embeddings.triton.targets import parse_triton_target

    try:
        return parse_triton_target(url, default_port).grpc_target
    except ValueError as error:
        raise ImproperlyConfigured(f"TRITON_SERVER_URL {url!r}: {error}") from None


# Used only with DJANGO_DEBUG on and no key given; refused as a key anywhere else.
DEBUG_ONLY_SECRET_KEY = "embedsite-local-development-only-not-secret"
MIN_SECRET_LENGTH = 32


def secret_weakness(value: str) -> str | None:
    """Why `value` is no secret (public, short, repetitive or Django's own placeholder), or None."""
    if value == DEBUG_ONLY_SECRET_KEY:
        return "it is the public debug-only key written in embedsite/settings.py"
    if value.startswith("django-insecure-"):
        return "it is a key Django generated for development (django-insecure-...)"
    if len(value) < MIN_SECRET_LENGTH:
        return f"it has {len(value)} characters, fewer than {MIN_SECRET_LENGTH}"
    if len(set(value)) < 5:
        return "it has fewer than 5 different characters"
    return None


def env_secret(name: str, value: str, *, debug: bool) -> str:
    """`value` (read from `name`), refused outside debug when it is weak."""
    reason = secret_weakness(value)
    if reason is not None and not debug:
        raise ImproperlyConfigured(
            f"{name} is not a usable secret: {reason}. Generate one with "
            '`python -c "import secrets; print(secrets.token_urlsafe(64))"`.'
        )
    return value


def secret_key_from_environment(*, debug: bool, default_file: Path) -> str:
    """DJANGO_SECRET_KEY, else the file DJANGO_SECRET_KEY_FILE names (Docker/Kubernetes secrets),
    else `default_file` when it exists (`make setup` writes it); without any, only debug runs (on a
    public key)."""
    value = os.environ.get("DJANGO_SECRET_KEY", "")
    source = "DJANGO_SECRET_KEY"
    if not value:
        named = os.environ.get("DJANGO_SECRET_KEY_FILE", "")
        path = Path(named) if named else (default_file if default_file.is_file() else None)
        if path is not None:
            source = f"DJANGO_SECRET_KEY_FILE ({path})"
            try:
                value = path.read_text().strip()
            except OSError as error:
                raise ImproperlyConfigured(f"{source} cannot be read: {error.strerror}") from None
            if not value:
                raise ImproperlyConfigured(f"{source} is empty")
    if not value:
        if debug:
            return DEBUG_ONLY_SECRET_KEY
        raise ImproperlyConfigured(
            "No secret key: set DJANGO_SECRET_KEY, or DJANGO_SECRET_KEY_FILE to a file holding one "
            f"(`make setup` writes {default_file}); DJANGO_DEBUG=true runs on a public key, locally only."
        )
    return env_secret(source, value, debug=debug)


DEBUG = env_bool("DJANGO_DEBUG", False)
# Keys sessions, CSRF, password resets, the encryption of tenants' webhook secrets and (unless split
# off below) API-key hashes: outside debug, settings refuse to load without a real one.
SECRET_KEY = secret_key_from_environment(debug=DEBUG, default_file=BASE_DIR / ".run" / "secret_key")
# Earlier keys, still accepted while a new one rolls out (sessions, and the tenants' webhook secrets
# encrypted under an old key stay readable until rotated). Comma-separated; each checked as the key.
SECRET_KEY_FALLBACKS = [
    env_secret("DJANGO_SECRET_KEY_FALLBACKS", key, debug=DEBUG)
    for key in env_list("DJANGO_SECRET_KEY_FALLBACKS", [])
]
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])

# --- HTTPS in production (README "Production settings"; `manage.py check --deploy` is clean with them)
# Behind a TLS-terminating proxy (ingress, load balancer) requests arrive as plain HTTP: believe its
# X-Forwarded-Proto. Only where the proxy sets that header on every request (a client's own is
# overwritten), else a client could claim https.
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("DJANGO_SECURE_PROXY_SSL_HEADER", False) else None
)
# Browsers reach the admin and the docs over https: plain-http requests are redirected there and
# the session and CSRF cookies never travel without TLS. The API paths (their lean stack, asgi.py)
# are not redirected: a probe or a client on plain http inside the cluster keeps working.
HTTPS = env_bool("DJANGO_HTTPS", False)
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", HTTPS)
SESSION_COOKIE_SECURE = HTTPS
CSRF_COOKIE_SECURE = HTTPS
# HSTS: browsers that once saw the header refuse plain http to this host for that long. One year by
# default once DJANGO_HTTPS is on (roll out with a small value first if unsure). The two flags below
# only reach this host's own subdomains; being preloaded still takes a submission to hstspreload.org.
SECURE_HSTS_SECONDS = env_int("DJANGO_SECURE_HSTS_SECONDS", 365 * 24 * 3600 if HTTPS else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", True)
# Origins (scheme://host[:port]) whose form posts the admin accepts besides its own host, e.g. the
# public https origin in front of a proxy that rewrites Host. Django refuses one without a scheme.
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])
for origin in CSRF_TRUSTED_ORIGINS:
    if urlsplit(origin).scheme not in {"http", "https"} or not urlsplit(origin).netloc:
        raise ImproperlyConfigured(
            f"DJANGO_CSRF_TRUSTED_ORIGINS: {origin!r} is not an origin like https://embeddings.example.com"
        )

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # Before staticfiles: `runserver` serves static files through WhiteNoise too, as uvicorn does.
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_prometheus",
    "axes",
    "embeddings",
]

MIDDLEWARE = [
    "embeddings.api.middleware.ArrivalTimeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (admin, Swagger UI, ReDoc) in every mode; answers before sessions and the rest.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: turns a locked-out login into the lockout page (admin login only:
    # the API's stack below has no sessions or passwords).
    "axes.middleware.AxesMiddleware",
]

# django-prometheus's PrometheusBeforeMiddleware/PrometheusAfterMiddleware are deliberately absent:
# they are sync MiddlewareMixins, two thread hops per request on our async path (see asgi.py).
# Request metrics are recorded by ApiView and the embedding service instead (embeddings/metrics.py).

# API routes (and health checks) run with this lean, async-only stack instead (embeddings/api/handler.py).
API_MIDDLEWARE = [
    "embeddings.api.middleware.ArrivalTimeMiddleware",
    "embeddings.api.middleware.ApiSecurityMiddleware",
]
API_PATH_PREFIXES = (
    "/v1/", "/v2/", "/api/v1/", "/embed", "/rerank", "/tokenize", "/decode", "/health", "/ready", "/metrics",
)  # fmt: skip
# POST /v1/embeddings answered without Django's and DRF's request layers when nothing in the request
# needs them (embeddings/api/express.py), byte for byte as the view answers; false: always the view.
EXPRESS_EMBEDDINGS = env_bool("EXPRESS_EMBEDDINGS", True)

# --- Admin login brute force (django-axes) ------------------------------------------------------
# Axes' backend first: it refuses a locked-out login before any password is checked.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# Failed logins counted per username *and* client address together: by username alone anyone could
# lock the real admin out; by address alone everyone behind one NAT or proxy would share a count.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_FAILURE_LIMIT = env_int("ADMIN_LOGIN_FAILURE_LIMIT", 5, minimum=1)
ADMIN_LOGIN_COOLOFF_MINUTES = env_float("ADMIN_LOGIN_COOLOFF_MINUTES", 15.0, minimum=0.1)
AXES_COOLOFF_TIME = timedelta(minutes=ADMIN_LOGIN_COOLOFF_MINUTES)
# A success clears that username+address's count; attempts during a lockout restart its cool-off.
AXES_RESET_ON_SUCCESS = True
AXES_HANDLER = "axes.handlers.database.AxesDatabaseHandler"
AXES_LOCKOUT_CALLABLE = "embeddings.admin_lockout.admin_lockout_response"
# REMOTE_ADDR as uvicorn sets it (django-ipware is not installed): X-Forwarded-For is believed only
# from the proxies uvicorn trusts (--forwarded-allow-ips, loopback by default).

ROOT_URLCONF = "embedsite.urls"
# API routes have no trailing slash (as OpenAI's); redirecting a POST would lose its body.
APPEND_SLASH = False
ASGI_APPLICATION = "embedsite.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": database_from_url(
        env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / '.run' / 'db.sqlite3'}"),
        # Seconds a connection is kept for the next request (0: closed after each); README: Databases.
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0),
        # A kept connection is tested before a request reuses it (a restarted database, a dropped link).
        conn_health_checks=env_bool("DATABASE_CONN_HEALTH_CHECKS", False),
    )
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
# `manage.py collectstatic` (run by `make setup` and the image build) writes here; WhiteNoise serves
# it. The image sets /app/staticfiles, outside any volume.
STATIC_ROOT = Path(env_str("DJANGO_STATIC_ROOT", str(BASE_DIR / ".run" / "static")))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Collected files get a content hash in their name (cached for a year, immutable) and gzip and
    # Brotli siblings WhiteNoise picks by Accept-Encoding, each distinct content compressed once
    # (embedsite/static_files.py). Outside DEBUG pages name the hashed files, so collectstatic must
    # have run; DEBUG serves the apps' files as they are.
    "staticfiles": {"BACKEND": "embedsite.static_files.CompressedOnceManifestStaticFilesStorage"},
}
# Source maps stay uncompressed: only a browser's developer tools fetch them, and Brotli at its
# highest level on their 7 MB (twice: the plain and the hashed name) was half of collectstatic's time.
WHITENOISE_SKIP_COMPRESS_EXTENSIONS = (*Compressor.SKIP_COMPRESS_EXTENSIONS, "map")

# Log lines (README "Observability"): `text`, readable, with the request id in brackets, or `json`,
# one object a line with the request's fields (embeddings/observability/logs.py); web, Celery
# worker and beat alike. LOG_ACCESS: one line per HTTP request (logger embedsite.access).
LOG_FORMAT = env_str("LOG_FORMAT", "text").strip().lower()
if LOG_FORMAT not in {"text", "json"}:
    raise ImproperlyConfigured(f"LOG_FORMAT must be text or json, not {LOG_FORMAT!r}")
LOG_ACCESS = env_bool("LOG_ACCESS", True)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_context": {"()": "embeddings.observability.logs.RequestContextFilter"}},
    "formatters": {
        "text": {"()": "embeddings.observability.logs.text_formatter"},
        "json": {"()": "embeddings.observability.logs.json_formatter"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "filters": ["request_context"]}
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # django-axes announces itself at INFO in every process (each manage.py command); its lockout
    # and failed-login lines come from other loggers and stay.
    "loggers": {"axes.apps": {"level": "WARNING"}},
}

# --- Serving -----------------------------------------------------------------------------------
SERVER_HOST = env_str("SERVER_HOST", "127.0.0.1")
SERVER_PORT = env_int("SERVER_PORT", 8080, minimum=1)
SERVER_WORKERS = env_int("SERVER_WORKERS", 1, minimum=1)
# Worker processes of `manage.py serve` (and runstack): WEB_CONCURRENCY, the name uvicorn and most
# platforms use, else SERVER_WORKERS.
WEB_CONCURRENCY = env_int("WEB_CONCURRENCY", SERVER_WORKERS, minimum=1)
# Graceful shutdown of `manage.py serve` (README "Graceful shutdown"): on SIGTERM /ready answers 503
# for SHUTDOWN_DRAIN_S while everything is still served (load balancers take the process out of
# rotation), then no new connection is accepted and requests in flight get SHUTDOWN_TIMEOUT_S more.
SHUTDOWN_DRAIN_S = env_float("SHUTDOWN_DRAIN_S", 0.0, minimum=0)
SHUTDOWN_TIMEOUT_S = env_float("SHUTDOWN_TIMEOUT_S", 20.0, minimum=0)
# The HTTP edge (embedsite/edge.py, README "Reliability and security"), per server process: a
# request line plus headers over HTTP_MAX_HEAD_BYTES or with more than HTTP_MAX_HEADERS fields is
# 431; a head not complete HTTP_HEAD_TIMEOUT_S after it could start is 408 and closed; kept-alive
# connections close after HTTP_KEEPALIVE_TIMEOUT_S idle; a response its client reads nothing of for
# HTTP_WRITE_TIMEOUT_S is cut. Beyond HTTP_MAX_CONNECTIONS the connection waiting longest for a head
# is closed, or the newcomer answered 503 (`serve` raises the file limit to fit, or lowers this).
HTTP_MAX_HEAD_BYTES = env_int("HTTP_MAX_HEAD_BYTES", 32 * 1024, minimum=1024)
HTTP_MAX_HEADERS = env_int("HTTP_MAX_HEADERS", 100, minimum=16)
HTTP_HEAD_TIMEOUT_S = env_float("HTTP_HEAD_TIMEOUT_S", 15.0, minimum=0.1)
HTTP_KEEPALIVE_TIMEOUT_S = env_float("HTTP_KEEPALIVE_TIMEOUT_S", 5.0, minimum=0.1)
HTTP_WRITE_TIMEOUT_S = env_float("HTTP_WRITE_TIMEOUT_S", 60.0, minimum=0.1)
HTTP_MAX_CONNECTIONS = env_int("HTTP_MAX_CONNECTIONS", 4096, minimum=1)

REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": ["embeddings.api.rendering.OrjsonRenderer"],
    "DEFAULT_PARSER_CLASSES": ["embeddings.api.rendering.OrjsonParser"],
    "DEFAULT_AUTHENTICATION_CLASSES": ["embeddings.api.authentication.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": [],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "embedsite",
    "DESCRIPTION": (
        "Multi-tenant text embeddings served by NVIDIA Triton. Authenticate with "
        "`Authorization: Bearer emb_...`. Errors use OpenAI's shape "
        '`{"error": {"message", "type", "param", "code"}}`.'
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema and docs pages are public. DRF's default authenticator (our API key class) is a
    # coroutine that drf-spectacular's sync views cannot call.
    "SERVE_AUTHENTICATION": [],
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI and ReDoc from the drf-spectacular-sidecar package: no CDN (deployments may be offline).
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Generating a schema imports embeddings/api/schema.py, which registers our extensions.
    "DEFAULT_GENERATOR_CLASS": "embeddings.api.schema.SchemaGenerator",
    # One name for the input types /v1/embeddings and /v1/jobs take (Cohere's own set differs).
    "ENUM_NAME_OVERRIDES": {"InputTypeEnum": "embeddings.model_tasks.INPUT_TYPE_NAMES"},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "embeddings.api.schema.edge_errors_hook",
        "embeddings.api.schema.closed_bodies_hook",
        "embeddings.api.schema.ratelimit_headers_hook",
        "embeddings.api.schema.object_links_hook",
    ],
}

# A revoked/expired key or a deactivated tenant stops working within this many seconds.
API_KEY_CACHE_SECONDS = env_float("API_KEY_CACHE_SECONDS", 5.0, minimum=0)
# Keyed hash of stored API key secrets; changing it invalidates every key. Defaults to SECRET_KEY
# (so every process that shares the key, manage.py create_api_key included, hashes alike).
API_KEY_HMAC_SECRET = (
    env_secret("API_KEY_HMAC_SECRET", os.environ["API_KEY_HMAC_SECRET"], debug=DEBUG)
    if os.environ.get("API_KEY_HMAC_SECRET")
    else SECRET_KEY
)
# Model catalog changes (admin edits) reach every server process within this many seconds.
MODEL_CACHE_SECONDS = env_float("MODEL_CACHE_SECONDS", 5.0, minimum=0)

# The model clients get when a request names none (seed shapes).
DEFAULT_EMBEDDING_MODEL = env_str("DEFAULT_EMBEDDING_MODEL", "all-MiniLM-L6-v2")

# --- API limits (per model overrides live on EmbeddingModel) -------------------------------------
MAX_INPUTS_PER_REQUEST = env_int("MAX_INPUTS_PER_REQUEST", 2048, minimum=1)
# Sized so that a request at the limit finishes well within EMBEDDING_TIMEOUT_S on the machine the
# defaults ship for (2 CPU cores: ~4,500 tokens/s of 256-token texts, so 32,768 tokens take ~7 s
# alone, ~4x headroom for sharing). A GPU deployment raises it (README: sizing the limits).
MAX_TOKENS_PER_REQUEST = env_int("MAX_TOKENS_PER_REQUEST", 32_768, minimum=1)
MAX_REQUEST_BODY_BYTES = env_int("MAX_REQUEST_BODY_BYTES", 16 * 1024 * 1024, minimum=1024)
# Long inputs embedded in chunks (`long_inputs: "chunk"`): neighbouring chunks share this many
# tokens (below the model's maximum less its special tokens, else the request is refused), and an
# input may make at most this many chunks (more: 413 naming it and its tokens).
CHUNK_OVERLAP_TOKENS = env_int("CHUNK_OVERLAP_TOKENS", 32, minimum=0)
MAX_CHUNKS_PER_INPUT = env_int("MAX_CHUNKS_PER_INPUT", 16, minimum=1)
# Rerank: documents one request may rank (Cohere's recommended maximum), and the most tokens a
# document keeps unless the request asks fewer (Cohere's max_tokens_per_doc default); the model's
# own maximum caps both. More documents are refused (413); a larger max_tokens_per_doc is outside the
# API schema (422).
RERANK_MAX_DOCUMENTS = env_int("RERANK_MAX_DOCUMENTS", 1000, minimum=1)
RERANK_MAX_TOKENS_PER_DOCUMENT = env_int("RERANK_MAX_TOKENS_PER_DOCUMENT", 4096, minimum=2)
# Inference requests one server process has in flight; beyond it, 429 with Retry-After at once.
MAX_INFLIGHT_TRITON_CALLS = env_int("MAX_INFLIGHT_TRITON_CALLS", 64, minimum=1)
# Admission (embeddings/api/admission.py), per server process, decided from the request head before
# any work: at most ADMISSION_MAX_IN_FLIGHT API requests run at once; the rest wait, the tenant with
# the fewest running going next, up to ADMISSION_QUEUE_TIMEOUT_S (then 429; 0: refuse at once
# instead of waiting) and ADMISSION_MAX_QUEUED of them (then the tenant with most waiting loses its
# newest). Half of MAX_INFLIGHT_TRITON_CALLS by default, so raising that for a GPU raises both: on
# the 2-core CPU 32 single texts at once already reach the peak, and admitting 64 only doubled the
# merged Triton call a newcomer waits behind (bench/overload.py, README "The HTTP edge").
ADMISSION_MAX_IN_FLIGHT = env_int(
    "ADMISSION_MAX_IN_FLIGHT", max(1, MAX_INFLIGHT_TRITON_CALLS // 2), minimum=1
)
ADMISSION_QUEUE_TIMEOUT_S = env_float("ADMISSION_QUEUE_TIMEOUT_S", 10.0, minimum=0)
ADMISSION_MAX_QUEUED = env_int("ADMISSION_MAX_QUEUED", HTTP_MAX_CONNECTIONS, minimum=0)
# Fair, bounded inference (embeddings/services/inference/scheduling.py): a request's rows go to Triton in
# sub-batches of at most MAX_BATCH_TOKENS padded tokens, and each server process keeps at most
# MAX_TOKENS_IN_FLIGHT of them at Triton, interleaving requests so a small one waits for about one
# sub-batch of a large one, never its backlog. On 2 CPU cores a 2,048-token sub-batch takes ~0.5 s
# alone and ~0.9 s beside another (two model instances).
MAX_BATCH_TOKENS = env_int("MAX_BATCH_TOKENS", 2048, minimum=1)
MAX_TOKENS_IN_FLIGHT = env_int("MAX_TOKENS_IN_FLIGHT", 2 * MAX_BATCH_TOKENS, minimum=1)
if MAX_TOKENS_IN_FLIGHT < MAX_BATCH_TOKENS:
    raise ImproperlyConfigured(
        f"MAX_TOKENS_IN_FLIGHT ({MAX_TOKENS_IN_FLIGHT}) must be at least "
        f"MAX_BATCH_TOKENS ({MAX_BATCH_TOKENS})"
    )
# Merge concurrent requests' sub-batches into one Triton call per model (embeddings/services/
# inference/coalescing.py): at most COALESCE_MAX_CALLS merged calls per model at Triton from one process;
# what arrives meanwhile leaves in the next call. Token-input models and one-sub-batch requests only.
# One call at a time measured best on the 2-core CPU at every load shape (bench/configs.py, README);
# with more Triton instances than server processes (a GPU), allow about one per instance.
COALESCE_REQUESTS = env_bool("COALESCE_REQUESTS", True)
COALESCE_MAX_CALLS = env_int("COALESCE_MAX_CALLS", 1, minimum=1)
# A request's whole inference (its turn in the scheduler and every sub-batch) ends by then: 504
# at the deadline, and its sub-batches not yet sent are dropped.
EMBEDDING_TIMEOUT_S = env_float("EMBEDDING_TIMEOUT_S", 30.0, minimum=0.01)
# Django refuses larger bodies before any view runs; our handler turns that into a 413.
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BODY_BYTES
# A request body (API paths; embeddings/api/intake.py) that stalls this long between two pieces,
# or takes longer than TIMEOUT_S + its size / MIN_BYTES_PER_S in all, is answered 408: a 16 MiB
# body gets 124 s, a 512 MiB upload about 35 minutes (a client at 2 Mbit/s or faster).
REQUEST_BODY_IDLE_TIMEOUT_S = env_float("REQUEST_BODY_IDLE_TIMEOUT_S", 10.0, minimum=0.1)
REQUEST_BODY_TIMEOUT_S = env_float("REQUEST_BODY_TIMEOUT_S", 60.0, minimum=0.1)
REQUEST_BODY_MIN_BYTES_PER_S = env_int("REQUEST_BODY_MIN_BYTES_PER_S", 256 * 1024, minimum=1)

# --- Triton ------------------------------------------------------------------------------------
# Names kept from the seed proxy: TRITON_SERVER_URL, TRITON_SERVER_GRPC_PORT, MODEL_NAME, ...
TRITON_SERVER_GRPC_PORT = env_int("TRITON_SERVER_GRPC_PORT", 8001, minimum=1)
TRITON_SERVER_URL = env_str("TRITON_SERVER_URL", "localhost")
TRITON_GRPC_TARGET = triton_grpc_target(TRITON_SERVER_URL, TRITON_SERVER_GRPC_PORT)
TRITON_GRPC_CHANNELS = env_int("TRITON_GRPC_CHANNELS", 4, minimum=1)
TRITON_TIMEOUT_S = env_float("TRITON_TIMEOUT_S", 30.0, minimum=0.001)
TRITON_RETRIES = env_int("TRITON_RETRIES", 2, minimum=0)
# One attempt of a call to Triton may take this long before it is sent again (to another replica)
# within TRITON_TIMEOUT_S; 0: a third of it with several replicas, all of it with one.
TRITON_ATTEMPT_TIMEOUT_S = env_float("TRITON_ATTEMPT_TIMEOUT_S", 0.0, minimum=0)
# Ping Triton connections with calls in flight this often (seconds), dropping one whose ping goes
# unanswered as long; 0: every 2 s with several replicas (a silent one found out within 4 s), every
# 360 s with one. Below 300 s each Triton must run with --grpc-http2-min-recv-ping-interval-without-data
# at or under it (the local Triton, compose and Kubernetes pass 1000 ms), or it answers GOAWAY.
TRITON_KEEPALIVE_S = env_float("TRITON_KEEPALIVE_S", 0.0, minimum=0)
TRITON_MAX_MESSAGE_BYTES = env_int("TRITON_MAX_MESSAGE_BYTES", 256 * 1024 * 1024, minimum=4 * 1024 * 1024)

MODEL_NAME = env_str("MODEL_NAME", "minilm")
MODEL_VERSION = env_str("MODEL_VERSION", "")
# Unset: read from Triton's model metadata.
INPUT_NAME = env_str("INPUT_NAME", "") or None
OUTPUT_NAME = env_str("OUTPUT_NAME", "") or None
EMBEDDING_SIZE = env_int("EMBEDDING_SIZE", 0, minimum=0) or None
# Pad sequence lengths up to one of these so Triton's native batcher can merge requests (GPU
# config); empty = pad to the longest input of the batch (the python-backend model batches ragged).
SEQUENCE_LENGTH_BUCKETS = [int(b) for b in env_list("SEQUENCE_LENGTH_BUCKETS", [])]

# The local Triton started by `manage.py runtriton` / `manage.py runstack`.
TRITON_MODEL_REPOSITORY = Path(env_str("TRITON_MODEL_REPOSITORY", str(BASE_DIR / "model_repository")))
TRITON_HTTP_PORT = env_int("TRITON_HTTP_PORT", 8000, minimum=1)
TRITON_METRICS_PORT = env_int("TRITON_METRICS_PORT", 8002, minimum=1)
TRITON_MODEL_CONFIG_NAME = env_str("TRITON_MODEL_CONFIG_NAME", "")
TRITON_STARTUP_TIMEOUT_S = env_float("TRITON_STARTUP_TIMEOUT_S", 180.0, minimum=1)
# Stopping (or after a crash) Triton's process group gets this long after SIGTERM, then SIGKILL.
TRITON_STOP_TIMEOUT_S = env_float("TRITON_STOP_TIMEOUT_S", 15.0, minimum=0.1)
# "explicit": the local Triton loads TRITON_STARTUP_MODELS at start, then what is loaded on request
# (the catalog's models, without a restart); "none" loads every folder of the repository at start.
TRITON_MODEL_CONTROL_MODE = env_str("TRITON_MODEL_CONTROL_MODE", "explicit")
if TRITON_MODEL_CONTROL_MODE not in ("explicit", "none", "poll"):
    raise ImproperlyConfigured(
        f"TRITON_MODEL_CONTROL_MODE must be explicit, none or poll, got {TRITON_MODEL_CONTROL_MODE!r}"
    )
# Loading the ensemble minilm_text loads the models it is made of too; they are named anyway.
TRITON_STARTUP_MODELS = env_list("TRITON_STARTUP_MODELS", ["minilm", "minilm_tokenizer", "minilm_text"])
# Deadline of a model load or unload through Triton's repository API (a load answers once ready).
TRITON_MODEL_LOAD_TIMEOUT_S = env_float("TRITON_MODEL_LOAD_TIMEOUT_S", 300.0, minimum=1)
RUN_DIR = Path(env_str("EMBEDSITE_RUN_DIR", str(BASE_DIR / ".run")))

# --- Readiness (/ready) ------------------------------------------------------------------------
# Each check (Triton, the default model, the database, Redis) gets at most this long.
READY_CHECK_TIMEOUT_S = env_float("READY_CHECK_TIMEOUT_S", 2.0, minimum=0.05)
# Quotas, usage and jobs live in Redis: /ready requires it (and the job store) unless this is off.
READY_CHECK_REDIS = env_bool("READY_CHECK_REDIS", True)

# --- Redis: quotas, usage counters, Celery's broker ----------------------------------------------
REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6390/0")
# `runstack` starts this binary (Debian's redis-server) on REDIS_URL's port, unless told not to
# (REDIS_URL names a Redis someone else runs).
REDIS_SERVER_BINARY = env_str("REDIS_SERVER_BINARY", "redis-server")
RUNSTACK_STARTS_REDIS = env_bool("RUNSTACK_STARTS_REDIS", True)
# Every Redis command's connect and read timeout: a stuck Redis fails a request, never hangs it.
REDIS_TIMEOUT_S = env_float("REDIS_TIMEOUT_S", 1.0, minimum=0.01)
# Connections per process's event loop; more concurrent commands wait for one (REDIS_TIMEOUT_S).
REDIS_MAX_CONNECTIONS = env_int("REDIS_MAX_CONNECTIONS", 64, minimum=1)
# The job store: jobs' inputs, results and progress (README "Job store and critical Redis"), kept
# apart from REDIS_URL (the critical Redis: quotas, usage counters, broker, channel layer) so job
# data filling it cannot refuse a quota check. Empty: the same Redis as REDIS_URL.
JOB_STORE_URL = env_str("JOB_STORE_URL", "")
# A chunk's inputs or results are up to megabytes: a longer timeout than the critical Redis's.
JOB_STORE_TIMEOUT_S = env_float("JOB_STORE_TIMEOUT_S", 5.0, minimum=0.01)
# The embedding cache (embeddings/services/inference/vector_cache.py, README "Embedding cache"):
# off by default. Its Redis is by default the job store's server, never REDIS_URL (the critical
# Redis): cached vectors filling it must not crowd out quota, usage or broker keys.
EMBEDDING_CACHE = env_bool("EMBEDDING_CACHE", False)
EMBEDDING_CACHE_REDIS_URL = env_str("EMBEDDING_CACHE_REDIS_URL", "")
EMBEDDING_CACHE_TTL_S = env_int("EMBEDDING_CACHE_TTL_S", 7 * 24 * 3600, minimum=1)
EMBEDDING_CACHE_LOCAL_ENTRIES = env_int("EMBEDDING_CACHE_LOCAL_ENTRIES", 10_000, minimum=0)
# Quotas count the tokens of inputs the cache answered (true), or give them back after the request
# (false). Usage records them either way (cached_inputs, cached_tokens), so bills can discount them.
EMBEDDING_CACHE_COUNT_HITS = env_bool("EMBEDDING_CACHE_COUNT_HITS", True)
# A lookup or a write slower than this counts as all misses (or is dropped): never a failed request.
EMBEDDING_CACHE_TIMEOUT_S = env_float("EMBEDDING_CACHE_TIMEOUT_S", 0.05, minimum=0.001)


def redis_server_of(url: str) -> tuple[str, str]:
    """The server a Redis URL names (host and port, or a unix socket's path): two databases of one
    server share its memory. Names are compared as written (nothing is resolved), loopback's aside."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return ("unix", parts.path)
    host = parts.hostname or "localhost"
    return ("loopback" if host in {"localhost", "127.0.0.1", "::1"} else host, str(parts.port or 6379))


if EMBEDDING_CACHE and redis_server_of(EMBEDDING_CACHE_REDIS_URL or JOB_STORE_URL or REDIS_URL) == (
    redis_server_of(REDIS_URL)
):
    raise ImproperlyConfigured(
        "EMBEDDING_CACHE is on but its Redis would be the critical one (REDIS_URL's server, where quotas, "
        "usage and the broker live): set EMBEDDING_CACHE_REDIS_URL, or JOB_STORE_URL, to another server"
    )
# maxmemory (MiB) of the Redis servers `runstack` starts (both with noeviction: a full Redis refuses
# writes instead of dropping keys); one server holding both roles gets the sum.
RUNSTACK_REDIS_MAXMEMORY_MB = env_int("RUNSTACK_REDIS_MAXMEMORY_MB", 256, minimum=1)
RUNSTACK_JOB_STORE_MAXMEMORY_MB = env_int("RUNSTACK_JOB_STORE_MAXMEMORY_MB", 2048, minimum=1)
# And of the embedding cache's, where EMBEDDING_CACHE is on with a local port of its own (evicting).
RUNSTACK_EMBEDDING_CACHE_MAXMEMORY_MB = env_int("RUNSTACK_EMBEDDING_CACHE_MAXMEMORY_MB", 256, minimum=1)

# --- runstack: restarting what dies (README "Reliability and security") --------------------------
# A child of `runstack` that dies (either Redis, Triton, the Celery worker or beat, the web server) is
# started again after RUNSTACK_RESTART_DELAY_S, doubled after each death that follows its restart
# within RUNSTACK_RESTART_STABLE_S, up to RUNSTACK_RESTART_MAX_DELAY_S; one that stayed up that long
# starts from the first delay again. After RUNSTACK_RESTART_ATTEMPTS restarts in a row that died that
# fast (5: about 15 s of delays, enough for a blip such as a port still held by a dying process), the
# next death stops the stack with the child's log: it would not go better by itself. 0: no restart.
RUNSTACK_RESTART_DELAY_S = env_float("RUNSTACK_RESTART_DELAY_S", 0.5, minimum=0)
RUNSTACK_RESTART_MAX_DELAY_S = env_float("RUNSTACK_RESTART_MAX_DELAY_S", 30.0, minimum=0)
RUNSTACK_RESTART_STABLE_S = env_float("RUNSTACK_RESTART_STABLE_S", 60.0, minimum=0)
RUNSTACK_RESTART_ATTEMPTS = env_int("RUNSTACK_RESTART_ATTEMPTS", 5, minimum=0)

# --- Quotas and usage ----------------------------------------------------------------------------
QUOTAS_ENABLED = env_bool("QUOTAS_ENABLED", True)
# When Redis cannot be reached: "closed" refuses requests with 503 (nothing goes unmetered),
# "open" serves them unmetered and logs it.
QUOTA_REDIS_FAILURE = env_str("QUOTA_REDIS_FAILURE", "closed")
if QUOTA_REDIS_FAILURE not in {"closed", "open"}:
    raise ImproperlyConfigured(f"QUOTA_REDIS_FAILURE must be 'closed' or 'open', not {QUOTA_REDIS_FAILURE!r}")
# A concurrency lease (max_concurrent_requests) left by a process that died mid-request frees
# itself after this long; above the longest request (Triton deadline and retries).
QUOTA_LEASE_SECONDS = env_float("QUOTA_LEASE_SECONDS", 120.0, minimum=1)
# The burst of a request or token rate whose burst is blank, as seconds of that rate: a request
# rate bursts one second's worth (at least one request), so a 6,000 RPM tenant sends 100 at once,
# then 100 a second; a token burst defaults to a whole minute's, so one request may still carry
# up to the TPM (the largest request a token rate admits is its burst).
RATE_LIMIT_REQUEST_BURST_SECONDS = env_float("RATE_LIMIT_REQUEST_BURST_SECONDS", 1.0, minimum=0.001)
RATE_LIMIT_TOKEN_BURST_SECONDS = env_float("RATE_LIMIT_TOKEN_BURST_SECONDS", 60.0, minimum=0.001)
# How often Celery beat folds Redis's usage counters into UsageBucket rows.
USAGE_FOLD_INTERVAL_S = env_float("USAGE_FOLD_INTERVAL_S", 60.0, minimum=1)
# How often Celery beat makes Triton serve what the catalog says (services/inference/serving.py): a
# restarted Triton gets the catalog's models back, and a switched version's old one is unloaded.
MODEL_RECONCILE_INTERVAL_S = env_float("MODEL_RECONCILE_INTERVAL_S", 60.0, minimum=1)

# --- Asynchronous jobs (/v1/jobs) ---------------------------------------------------------------
# The job kinds the engine runs (embeddings/services/jobs/kinds.py): a job's kind says how its chunks
# are embedded and what happens at its end. The engine imports none of them; they are named here.
JOB_KINDS = {
    "embeddings": "embeddings.services.jobs.kinds.EMBEDDINGS",
    "batch": "embeddings.services.openai_api.batches.BATCH_JOB_KIND",
}
# Results (and inputs) stay in Redis this long after submission; the job says when (expires_at).
JOB_RESULT_TTL_S = env_int("JOB_RESULT_TTL_S", 7 * 24 * 3600, minimum=60)
# An operator may extend a job's expiry (the admin) up to this long after its submission, no more:
# its data stays held against its tenant's job storage budget meanwhile.
JOB_MAX_RETENTION_S = env_int("JOB_MAX_RETENTION_S", 30 * 24 * 3600, minimum=60)
if JOB_MAX_RETENTION_S < JOB_RESULT_TTL_S:
    raise ImproperlyConfigured(
        f"JOB_MAX_RETENTION_S ({JOB_MAX_RETENTION_S}) is shorter than JOB_RESULT_TTL_S ({JOB_RESULT_TTL_S}): "
        "no job could be kept as long as it is by default"
    )
# Inputs per chunk: the unit a worker embeds, stores and counts at once.
JOB_CHUNK_SIZE = env_int("JOB_CHUNK_SIZE", 256, minimum=1)
# Inputs per job when the tenant sets no max_inputs_per_job.
JOB_MAX_INPUTS = env_int("JOB_MAX_INPUTS", 1_000_000, minimum=1)
JOB_MAX_UPLOAD_BYTES = env_int("JOB_MAX_UPLOAD_BYTES", 512 * 1024 * 1024, minimum=1024)
JOB_MAX_LINE_BYTES = env_int("JOB_MAX_LINE_BYTES", 64 * 1024, minimum=16)
# Chunks of one job queued in the broker at a time: a big job cannot bury another tenant's small one.
JOB_CHUNKS_IN_FLIGHT = env_int("JOB_CHUNKS_IN_FLIGHT", 2, minimum=1)
# A chunk retries Triton this many times (with backoff) before its inputs count as failed.
JOB_CHUNK_RETRIES = env_int("JOB_CHUNK_RETRIES", 5, minimum=0)
# Callbacks are signed with each tenant's own webhook secret (embeddings/services/accounts/tenants.py), and
# go only to globally reachable addresses (embeddings/services/jobs/callback_targets.py), plus these
# networks, named as CIDRs, for deployments whose receivers are internal ("10.0.0.0/8,127.0.0.1/32").
JOB_CALLBACK_ALLOWED_NETWORKS = env_networks("JOB_CALLBACK_ALLOWED_NETWORKS")
# A callback host must resolve within this long, at submission (else 422) and at delivery (else retried).
JOB_CALLBACK_RESOLVE_TIMEOUT_S = env_float("JOB_CALLBACK_RESOLVE_TIMEOUT_S", 3.0, minimum=0.1)
# PEM file of the CAs https callbacks are verified against instead of the system's (a private CA).
JOB_CALLBACK_CA_FILE = env_str("JOB_CALLBACK_CA_FILE", "")
if JOB_CALLBACK_CA_FILE and not Path(JOB_CALLBACK_CA_FILE).is_file():
    raise ImproperlyConfigured(f"JOB_CALLBACK_CA_FILE: no file {JOB_CALLBACK_CA_FILE!r}")
JOB_CALLBACK_RETRIES = env_int("JOB_CALLBACK_RETRIES", 6, minimum=0)
# A failed callback is retried after BACKOFF_S * 2^attempt seconds (at most an hour).
JOB_CALLBACK_BACKOFF_S = env_float("JOB_CALLBACK_BACKOFF_S", 5.0, minimum=0.0)
# A chunk whose Triton call failed (unavailable, timeout) is retried after BACKOFF_S * 2^attempt
# seconds, at most BACKOFF_MAX_S (keep it under CELERY_VISIBILITY_TIMEOUT_S: a countdown longer
# than the visibility timeout gets the message delivered twice).
JOB_CHUNK_RETRY_BACKOFF_S = env_float("JOB_CHUNK_RETRY_BACKOFF_S", 2.0, minimum=0.0)
JOB_CHUNK_RETRY_BACKOFF_MAX_S = env_float("JOB_CHUNK_RETRY_BACKOFF_MAX_S", 60.0, minimum=0.0)
# A running chunk holds a lease its worker renews every third of this (a heartbeat thread); once
# it lapses (the worker died) beat's watchdog, every WATCHDOG_INTERVAL_S, re-sends the chunk: a lost
# worker's job resumes within about LEASE_S + WATCHDOG_INTERVAL_S.
JOB_CHUNK_LEASE_S = env_float("JOB_CHUNK_LEASE_S", 30.0, minimum=0.3)
JOB_WATCHDOG_INTERVAL_S = env_float("JOB_WATCHDOG_INTERVAL_S", 15.0, minimum=0.1)
# A chunk handed out this long ago that never started (its message lost with a worker killed
# between taking and starting it) is re-sent; one merely waiting in a long queue then gets a
# harmless duplicate, so keep it above the usual queue wait.
JOB_STALL_S = env_float("JOB_STALL_S", 120.0, minimum=1.0)
JOB_EXPIRE_INTERVAL_S = env_float("JOB_EXPIRE_INTERVAL_S", 300.0, minimum=0.1)
# Admission by bytes (embeddings/services/jobs/budget.py; README "Sizing the job store"): a job is
# refused at submission when what it would hold in the job store (inputs + inputs x dimensions x
# bytes per value) does not fit its tenant's budget (Tenant.job_storage_budget_bytes, else this
# default) or the global one. Keep the global budget x 1.25 (Redis's allocator rounding) under
# the job store's maxmemory.
JOB_STORAGE_TENANT_BUDGET_BYTES = env_int("JOB_STORAGE_TENANT_BUDGET_BYTES", 1 << 30, minimum=0)
JOB_STORAGE_GLOBAL_BUDGET_BYTES = env_int("JOB_STORAGE_GLOBAL_BUDGET_BYTES", 1536 << 20, minimum=0)

# --- Files and batches (OpenAI's /v1/files and /v1/batches; embeddings/services/openai_api/files.py) -------
# Uploaded and output files live in the "files" storage: a directory every web and worker process
# shares (a volume in compose/Kubernetes), or any Django storage backend named by FILES_STORAGE_BACKEND.
FILES_STORAGE_DIR = Path(env_str("FILES_STORAGE_DIR", str(RUN_DIR / "files")))
STORAGES["files"] = {
    "BACKEND": env_str("FILES_STORAGE_BACKEND", "django.core.files.storage.FileSystemStorage"),
    "OPTIONS": {"location": str(FILES_STORAGE_DIR)},
}
# OpenAI's limits: 512 MB a file, 200 MB for a batch's input.
FILES_MAX_UPLOAD_BYTES = env_int("FILES_MAX_UPLOAD_BYTES", 512 * 1000 * 1000, minimum=1024)
BATCH_MAX_INPUT_FILE_BYTES = env_int("BATCH_MAX_INPUT_FILE_BYTES", 200 * 1000 * 1000, minimum=1024)
BATCH_MAX_REQUESTS = env_int("BATCH_MAX_REQUESTS", 50_000, minimum=1)
BATCH_MAX_INPUTS = env_int("BATCH_MAX_INPUTS", 50_000, minimum=1)
# How long a batch's output and error files are kept (OpenAI: 30 days).
BATCH_OUTPUT_TTL_S = env_int("BATCH_OUTPUT_TTL_S", 30 * 24 * 3600, minimum=60)
# A batch whose validation or finalisation has not moved for this long is handed to a worker again
# (its task was lost with a worker); both are idempotent.
BATCH_STALL_S = env_float("BATCH_STALL_S", 120.0, minimum=1.0)

# --- Channel layer: job progress to WebSocket watchers (WS /ws/v1/jobs/<id>) ---------------------
# On the same Redis under its own key prefix; web processes and Celery workers must share it.
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": "embedsite:channels:"},
    }
}

# --- Celery --------------------------------------------------------------------------------------
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Fair share between jobs: each worker process holds one message at a time, so chunks of the jobs
# in the queue take turns (embeddings.services.jobs.engine). Unacked messages (acks_late) come back after
# the visibility timeout, which must be above the longest chunk and the longest retry countdown
# (a dead worker's chunk is re-sent by the watchdog long before; the late redelivery is a no-op).
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_VISIBILITY_TIMEOUT_S = env_int("CELERY_VISIBILITY_TIMEOUT_S", 3600, minimum=60)
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": CELERY_VISIBILITY_TIMEOUT_S}
CELERY_BEAT_SCHEDULE = {
    "fold-usage": {
        "task": "embeddings.tasks.usage_fold_task",
        "schedule": USAGE_FOLD_INTERVAL_S,
        # A fold not started within one interval is superseded by the next: a worker that was down
        # for a day does not find a day of folds queued.
        "options": {"expires": USAGE_FOLD_INTERVAL_S},
    },
    "expire-jobs": {
        "task": "embeddings.tasks.job_expire_task",
        "schedule": JOB_EXPIRE_INTERVAL_S,
        "options": {"expires": JOB_EXPIRE_INTERVAL_S},
    },
    "job-watchdog": {
        "task": "embeddings.tasks.job_watchdog_task",
        "schedule": JOB_WATCHDOG_INTERVAL_S,
        # Priority 0 (Redis serves it first): ahead of the chunks (jobs.CHUNK_PRIORITY) it watches.
        "options": {"expires": JOB_WATCHDOG_INTERVAL_S, "priority": 0},
    },
    "reconcile-models": {
        "task": "embeddings.tasks.models_reconcile_task",
        "schedule": MODEL_RECONCILE_INTERVAL_S,
        "options": {"expires": MODEL_RECONCILE_INTERVAL_S},
    },
}
CELERY_BEAT_SCHEDULE_FILENAME = str(RUN_DIR / "celerybeat-schedule")
