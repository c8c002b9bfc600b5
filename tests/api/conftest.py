"""API fixtures: the real ASGI application (in process) backed by the real Triton, two tenants."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from embeddings.models import ApiKey, EmbeddingModel, Tenant
from embeddings.services.catalog import embedding_model_register_local
from embeddings.services.keys import api_key_create
from embeddings.services.tenants import tenant_create


@dataclass
class TenantWithKey:
    tenant: Tenant
    api_key: ApiKey
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


def _make_tenant(name: str) -> TenantWithKey:
    tenant = tenant_create(name=name)
    api_key, secret = api_key_create(tenant=tenant, name=f"{name} key")
    return TenantWithKey(tenant, api_key, secret)


@pytest.fixture
def api_setup(transactional_db, service_triton, settings):
    """The local model registered, and two tenants with one key each (data committed: the ASGI
    app reads it from other threads)."""
    settings.API_KEY_CACHE_SECONDS = 0.2
    model = embedding_model_register_local(repository=Path(settings.TRITON_MODEL_REPOSITORY))
    return {"model": model, "alpha": _make_tenant("Alpha"), "beta": _make_tenant("Beta")}


@pytest.fixture
def model(api_setup) -> EmbeddingModel:
    return api_setup["model"]


@pytest.fixture
def alpha(api_setup) -> TenantWithKey:
    return api_setup["alpha"]


@pytest.fixture
def beta(api_setup) -> TenantWithKey:
    return api_setup["beta"]


@pytest.fixture
async def client(api_setup) -> AsyncIterator[httpx2.AsyncClient]:
    """An HTTP client speaking to the real ASGI application (channels router included)."""
    from embedsite.asgi import application

    transport = httpx2.ASGITransport(app=application)
    async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http
