"""`Authorization: Bearer emb_...` for every API route: an async authenticator with a short cache.

A request must not hit the database each time, so what a key resolves to is cached in-process for
API_KEY_CACHE_SECONDS (keyed by a hash of the key, never the key itself). A revoked or expired key
or a deactivated tenant therefore stops working within that many seconds. Refusals are cached for
at most a second, so a key created a moment ago works at once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone
from rest_framework.request import Request

from embeddings.callers import Caller, QuotaLimitValues
from embeddings.errors.answers import ApiError, Forbidden, ModelForbidden, ModelNotFound, Unauthorized
from embeddings.models import ApiKey, EmbeddingModel
from embeddings.services.accounts.api_keys import api_key_for_secret, api_key_touch, parse_api_key
from embeddings.services.inference import catalog
from embeddings.services.inference.embedding import embedding_model_check
from embeddings.single_flight import SingleFlight

logger = logging.getLogger(__name__)

NEGATIVE_CACHE_SECONDS = 1.0
CACHE_MAX_ENTRIES = 10_000


def ensure_model_allowed(caller: Caller, model: EmbeddingModel) -> None:
    if not caller.may_use(model):
        raise ModelForbidden(f"This API key may not use the model {model.name!r}.", param="model")


def _caller_for_key(key: str) -> Caller | ApiError:
    """The caller for a key, or the error to answer with (both are cached)."""
    api_key: ApiKey | None = api_key_for_secret(key=key)
    if api_key is None:
        return Unauthorized("Incorrect API key provided.")
    if api_key.is_revoked():
        return Unauthorized("This API key has been revoked.", code="api_key_revoked")
    if api_key.is_expired():
        return Unauthorized("This API key has expired.", code="api_key_expired")
    tenant = api_key.tenant
    if not tenant.is_active:
        return Forbidden("This API key's tenant is inactive.", code="tenant_inactive")
    allowed = (
        frozenset(tenant.allowed_models.values_list("pk", flat=True))
        if not tenant.allow_all_models
        else frozenset()
    )
    return Caller(
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        key_id=api_key.pk,
        key_public_id=api_key.public_id,
        allow_all_models=tenant.allow_all_models,
        allowed_model_ids=allowed,
        expires_at=api_key.expires_at,
        shared_embedding_cache=tenant.shared_embedding_cache,
        tenant_limits=QuotaLimitValues.of(tenant),
        key_limits=QuotaLimitValues.of(api_key),
    )


class CallerCache:
    """key digest -> (expiry on `clock`, caller or error). `clock` is time.monotonic; a test may
    give the cache a clock it moves itself, to cross a TTL without waiting for it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.entries: dict[str, tuple[float, Caller | ApiError]] = {}
        self.last_touched: dict[int, float] = {}

    def get(self, digest: str) -> Caller | ApiError | None:
        entry = self.entries.get(digest)
        if entry is None or entry[0] < self.clock():
            return None
        return entry[1]

    def put(self, digest: str, value: Caller | ApiError) -> None:
        if len(self.entries) >= CACHE_MAX_ENTRIES:
            # Bounded: drop what has expired; if a flood of distinct keys filled it, start afresh
            # (rebuilding costs one query per key).
            now = self.clock()
            self.entries = {d: entry for d, entry in self.entries.items() if entry[0] >= now}
            if len(self.entries) >= CACHE_MAX_ENTRIES:
                self.entries.clear()
        ttl = settings.API_KEY_CACHE_SECONDS
        if isinstance(value, ApiError):
            ttl = min(ttl, NEGATIVE_CACHE_SECONDS)
        self.entries[digest] = (self.clock() + ttl, value)

    def tenant_id_for(self, digest: str) -> int | None:
        """The tenant of a key this process has verified, expired entries included (admission only
        orders requests by it: authentication still decides), else None."""
        entry = self.entries.get(digest)
        if entry is None or isinstance(entry[1], ApiError):
            return None
        return entry[1].tenant_id

    def should_touch(self, key_id: int) -> bool:
        """At most one last_used_at UPDATE per key per minute from this process."""
        now = self.clock()
        if now - self.last_touched.get(key_id, -1e9) < 60:
            return False
        self.last_touched[key_id] = now
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.last_touched.clear()


caller_cache = CallerCache()
_key_lookups: SingleFlight[Caller | ApiError] = SingleFlight()


async def _caller_looked_up(key: str, digest: str) -> Caller | ApiError:
    result = await sync_to_async(_caller_for_key)(key)
    caller_cache.put(digest, result)
    return result


async def _touch(key_id: int) -> None:
    """Best-effort bookkeeping: a busy or locked database must not fail the request it records."""
    try:
        await sync_to_async(api_key_touch)(api_key_id=key_id)
    except DatabaseError as error:
        logger.warning("could not record the use of API key %s: %s", key_id, error)


async def caller_for_api_key(key: str) -> Caller:
    """The caller for a raw key (HTTP header or WebSocket subprotocol), through the cache;
    raises the ApiError to answer with (Unauthorized, Forbidden) when the key may not be used."""
    if parse_api_key(key) is None:
        # Refused without the database or the cache: garbage cannot fill either.
        raise Unauthorized(
            "Malformed API key: embedsite keys look like 'emb_<id>_<secret>'.",
            code="malformed_api_key",
        )
    digest = hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()
    result = caller_cache.get(digest)
    if result is None:
        # Once for all the requests with this key that find its entry expired together.
        result = await _key_lookups.run(digest, lambda: _caller_looked_up(key, digest))
    if isinstance(result, ApiError):
        # A fresh instance each time: re-raising one cached object would chain its tracebacks.
        raise type(result)(result.message, code=result.error_code, param=result.param)
    if result.expires_at is not None and result.expires_at <= timezone.now():
        raise Unauthorized("This API key has expired.", code="api_key_expired")
    if caller_cache.should_touch(result.key_id):
        await _touch(result.key_id)
    return result


class ApiKeyAuthentication:
    """DRF authentication class (awaited by embeddings.api.base.ApiView)."""

    keyword = "Bearer"

    async def authenticate(self, request: Request) -> tuple[Caller, None]:
        return await caller_for_authorization(request._request.headers.get("Authorization", "")), None

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


async def caller_for_authorization(header: str) -> Caller:
    """The caller an `Authorization` header's value names; raises Unauthorized or Forbidden."""
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if not header:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer emb_...'.",
            code="missing_api_key",
        )
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Send the API key as 'Authorization: Bearer emb_...'.")
    return await caller_for_api_key(key)


class ModelCall(Protocol):
    """What model_for_request needs of a request's handler (an ApiView, or the express lane's
    embeddings call): the authenticated caller, and where the model's name goes."""

    caller: Caller | None
    model_name: str


async def model_for_request(call: ModelCall, name: str | None, *, embeds: bool = True) -> EmbeddingModel:
    """The model a request names (or the default), which this key must be allowed to use and,
    with `embeds`, which makes embeddings (not a rerank model).

    The request's metrics are labelled with it from here on (errors included).
    """
    model = await catalog.embedding_model_resolve(name=name or settings.DEFAULT_EMBEDDING_MODEL)
    if model is None:
        raise ModelNotFound(
            f"The model {name!r} does not exist or you do not have access to it.", param="model"
        )
    call.model_name = model.name
    ensure_model_allowed(call.caller, model)
    if embeds:
        embedding_model_check(model)
    return model
