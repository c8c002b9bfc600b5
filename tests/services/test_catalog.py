"""Model catalog: lookup by name or alias, disabled models hidden, what each tenant may use."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync

from embeddings.models import EmbeddingModel
from embeddings.services.catalog import (
    CatalogError,
    embedding_model_cache_clear,
    embedding_model_for_name,
    embedding_model_register_local,
    embedding_model_resolve,
    embedding_models_for_tenant,
)
from embeddings.services.tenants import tenant_create, tenant_deactivate, tenant_may_use_model
from tests.conftest import write_finished_export


def make_model(name: str, *, aliases: list[str] | None = None, enabled: bool = True) -> EmbeddingModel:
    return EmbeddingModel.objects.create(
        name=name,
        aliases=aliases or [],
        triton_model=name.lower(),
        dimensions=384,
        max_tokens=256,
        enabled=enabled,
    )


@pytest.fixture
def models(db) -> dict[str, EmbeddingModel]:
    return {
        "minilm": make_model(
            "all-MiniLM-L6-v2", aliases=["minilm", "sentence-transformers/all-MiniLM-L6-v2"]
        ),
        "e5": make_model("e5-small", aliases=["e5"]),
        "old": make_model("retired-model", aliases=["retired"], enabled=False),
    }


def test_lookup_by_name_and_alias(models):
    assert embedding_model_for_name(name="all-MiniLM-L6-v2") == models["minilm"]
    assert embedding_model_for_name(name="minilm") == models["minilm"]
    assert embedding_model_for_name(name="sentence-transformers/all-MiniLM-L6-v2") == models["minilm"]
    assert embedding_model_for_name(name="e5") == models["e5"]


def test_unknown_names_find_nothing(models):
    assert embedding_model_for_name(name="gpt-4") is None
    assert embedding_model_for_name(name="MINILM") is None  # names are exact
    assert embedding_model_for_name(name="") is None


def test_disabled_models_are_invisible(models):
    assert embedding_model_for_name(name="retired-model") is None
    assert embedding_model_for_name(name="retired") is None
    assert models["old"] not in embedding_models_for_tenant(tenant=tenant_create(name="Alpha"))


def test_tenant_with_all_models_sees_every_enabled_model(models):
    alpha = tenant_create(name="Alpha")

    assert embedding_models_for_tenant(tenant=alpha) == [models["minilm"], models["e5"]]
    assert tenant_may_use_model(tenant=alpha, model=models["e5"])


def test_restricted_tenant_sees_only_its_models(models):
    alpha = tenant_create(name="Alpha")
    beta = tenant_create(name="Beta", allow_all_models=False)
    beta.allowed_models.add(models["e5"], models["old"])

    assert embedding_models_for_tenant(tenant=beta) == [models["e5"]]  # allowed and enabled
    assert tenant_may_use_model(tenant=beta, model=models["e5"])
    assert not tenant_may_use_model(tenant=beta, model=models["minilm"])
    # Beta's restriction does not narrow alpha.
    assert tenant_may_use_model(tenant=alpha, model=models["minilm"])


def test_restricted_tenant_with_no_models_sees_none(models):
    gamma = tenant_create(name="Gamma", allow_all_models=False)
    assert embedding_models_for_tenant(tenant=gamma) == []
    assert not tenant_may_use_model(tenant=gamma, model=models["minilm"])


def test_tenant_create_and_deactivate(db):
    tenant = tenant_create(name="Acme Corp")
    assert (tenant.slug, tenant.is_active, tenant.allow_all_models) == ("acme-corp", True, True)
    assert tenant_create(name="Other", slug="custom").slug == "custom"
    with pytest.raises(ValueError):
        tenant_create(name="!!!")

    tenant_deactivate(tenant=tenant)
    tenant.refresh_from_db()
    assert not tenant.is_active


def test_register_local_model_reads_the_export(db, tmp_path):
    write_finished_export(tmp_path, max_tokens=256)

    model = embedding_model_register_local(repository=tmp_path)

    assert (model.name, model.triton_model, model.dimensions, model.max_tokens) == (
        "all-MiniLM-L6-v2",
        "minilm",
        384,
        256,
    )
    assert embedding_model_for_name(name="minilm") == model


def test_register_local_model_is_idempotent_and_clears_the_request_path_cache(db, tmp_path, settings):
    settings.MODEL_CACHE_SECONDS = 3600
    write_finished_export(tmp_path, max_tokens=256)
    resolve = async_to_sync(embedding_model_resolve)
    embedding_model_cache_clear()
    assert resolve(name="minilm") is None  # the per-process cache now holds "no models"

    first = embedding_model_register_local(repository=tmp_path)
    assert resolve(name="minilm") == first  # served at once, not after MODEL_CACHE_SECONDS

    write_finished_export(tmp_path, max_tokens=512)
    second = embedding_model_register_local(repository=tmp_path)
    assert second.pk == first.pk and EmbeddingModel.objects.count() == 1
    assert resolve(name="minilm").max_tokens == 512


def test_register_local_model_needs_the_export(db, tmp_path):
    with pytest.raises(CatalogError, match="export_model"):
        embedding_model_register_local(repository=tmp_path)
