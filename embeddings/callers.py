"""Who is calling, and the limits they are held to: one type below both the API and the services.

The API's authenticator builds a `Caller` for each API key (embeddings/api/authentication.py); a
job's submission builds one for the tenant and key that submit it (services/jobs/submission.py).
Quotas, catalog and jobs take this type, so nothing under embeddings/services needs embeddings/api.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from embeddings.models import EmbeddingModel


@dataclass(frozen=True)
class QuotaLimitValues:
    """One level's limits (a tenant's or a key's); None = no limit at that level."""

    requests_per_second: int | None = None
    requests_per_minute: int | None = None
    request_burst: int | None = None
    tokens_per_minute: int | None = None
    token_burst: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    max_inputs_per_request: int | None = None
    max_concurrent_requests: int | None = None
    max_concurrent_jobs: int | None = None
    max_inputs_per_job: int | None = None

    @classmethod
    def of(cls, owner) -> QuotaLimitValues:
        """The limits of a Tenant or ApiKey (anything with QuotaLimits' fields)."""
        return cls(**{field.name: getattr(owner, field.name) for field in fields(cls)})

    def needs_redis(self) -> bool:
        return any(
            value is not None
            for value in (
                self.requests_per_second,
                self.requests_per_minute,
                self.tokens_per_minute,
                self.tokens_per_day,
                self.tokens_per_month,
                self.max_concurrent_requests,
            )
        )


NO_LIMITS = QuotaLimitValues()


@dataclass(frozen=True)
class Caller:
    """A tenant, through one of its keys (or none: a job without a key), and the limits both hold
    it to. The authenticator caches it with the key, so the request path reads no quota from the
    database. Positional order is that of what quotas need: tenant, key, their limits."""

    tenant_id: int
    key_id: int | None
    tenant_limits: QuotaLimitValues = NO_LIMITS
    key_limits: QuotaLimitValues = NO_LIMITS
    tenant_slug: str = ""
    key_public_id: str = ""
    # A caller built without the tenant's model list may use no model: the safe default.
    allow_all_models: bool = False
    allowed_model_ids: frozenset[int] = field(default_factory=frozenset)
    expires_at: datetime | None = None
    # The tenant opted in to the embedding cache's shared scope (Tenant.shared_embedding_cache).
    shared_embedding_cache: bool = False
    is_authenticated: bool = True  # for DRF permission classes

    def may_use(self, model: EmbeddingModel) -> bool:
        return self.allow_all_models or model.pk in self.allowed_model_ids

    def cache_scope_for(self, model: EmbeddingModel) -> str:
        """Its entries' scope in the embedding cache for `model` (`embedding_cache_scope`)."""
        return embedding_cache_scope(
            tenant_id=self.tenant_id, tenant_shared=self.shared_embedding_cache, model=model
        )


# The embedding cache's scope of every tenant and model that opted in (a tenant's is "tenant:<id>").
SHARED_CACHE_SCOPE = "shared"


def embedding_cache_scope(*, tenant_id: int, tenant_shared: bool, model: EmbeddingModel) -> str:
    """A tenant's entries' scope in the embedding cache for `model`: its own, which no other tenant
    reads, unless the tenant (`tenant_shared`) or the model opted in to the scope shared by all who
    did. A request's from its Caller, a job's chunk's from its tenant's row as it runs."""
    if tenant_shared or model.shared_embedding_cache:
        return SHARED_CACHE_SCOPE
    return f"tenant:{tenant_id}"
