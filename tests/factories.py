"""Rows the tests need often, built one way."""

from __future__ import annotations

from datetime import datetime

from embeddings.models import UsageBucket


def usage_bucket(
    tenant,
    api_key,
    hour: datetime,
    *,
    model: str = "all-MiniLM-L6-v2",
    endpoint: str = "embeddings",
    **counters,
) -> UsageBucket:
    """One hour of folded usage for a tenant (and key, or None), as the fold writes it; counters
    not given (requests, tokens, succeeded, ...) are 0."""
    return UsageBucket.objects.create(
        tenant=tenant, api_key=api_key, model=model, endpoint=endpoint, hour=hour, **counters
    )
