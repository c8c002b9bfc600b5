"""Model catalog: lookup by name or alias, disabled models hidden, what each tenant may use.

Read the way requests read it: names through the per-process cache (`embedding_model_resolve`),
a tenant's models through the caller the API key authenticator builds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync

from embeddings.api.authentication import caller_cache, caller_for_api_key
from embeddings.callers import Caller
from embeddings.models import EmbeddingModel, Tenant
from embeddings.services.accounts.api_keys import api_key_create
from embeddings.services.accounts.tenants import tenant_create, tenant_deactivate
from embeddings.services.inference import catalog
from embeddings.services.inference.catalog import (
    CatalogError,
    embedding_model_cache_clear,
    embedding_model_register_local,
    embedding_model_resolve,
    embedding_models_for_caller,
)
from tests.conftest import write_finished_export

resolve = async_to_sync(embedding_model_resolve)


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
    created = {
        "minilm": make_model(
            "all-MiniLM-L6-v2", aliases=["minilm", "sentence-transformers/all-MiniLM-L6-v2"]
        ),
        "e5": make_model("e5-small", aliases=["e5"]),
        "old": make_model("retired-model", aliases=["retired"], enabled=False),
    }
    embedding_model_cache_clear()
    return created


def caller_for(tenant: Tenant) -> Caller:
    """The caller a request with a new key of `tenant` is served as."""
    caller_cache.clear()
    _, secret = api_key_create(tenant=tenant, name="catalog test")
    return async_to_sync(caller_for_api_key)(secret)


def models_for(tenant: Tenant) -> list[EmbeddingModel]:
    """What GET /v1/models lists for a key of `tenant`."""
    return async_to_sync(embedding_models_for_caller)(caller=caller_for(tenant))


def test_lookup_by_name_and_alias(models):
    assert resolve(name="all-MiniLM-L6-v2") == models["minilm"]
    assert resolve(name="minilm") == models["minilm"]
    assert resolve(name="sentence-transformers/all-MiniLM-L6-v2") == models["minilm"]
    assert resolve(name="e5") == models["e5"]


def test_requests_that_find_the_cache_expired_together_read_the_catalog_once(models, monkeypatch):
    reads = []
    enabled = catalog.embedding_models_enabled
    monkeypatch.setattr(catalog, "embedding_models_enabled", lambda: reads.append(1) or enabled())

    async def twenty_lookups():
        return await asyncio.gather(*(embedding_model_resolve(name="e5") for _ in range(20)))

    assert {model.pk for model in async_to_sync(twenty_lookups)()} == {models["e5"].pk}
    assert reads == [1]


def test_unknown_names_find_nothing(models):
    assert resolve(name="gpt-4") is None
    assert resolve(name="MINILM") is None  # names are exact
    assert resolve(name="") is None


def test_disabled_models_are_invisible(models):
    assert resolve(name="retired-model") is None
    assert resolve(name="retired") is None
    assert models["old"] not in models_for(tenant_create(name="Alpha"))


def test_tenant_with_all_models_sees_every_enabled_model(models):
    alpha = tenant_create(name="Alpha")

    assert models_for(alpha) == [models["minilm"], models["e5"]]
    assert caller_for(alpha).may_use(models["e5"])


def test_restricted_tenant_sees_only_its_models(models):
    alpha = tenant_create(name="Alpha")
    beta = tenant_create(name="Beta", allow_all_models=False)
    beta.allowed_models.add(models["e5"], models["old"])

    assert models_for(beta) == [models["e5"]]  # allowed and enabled
    assert caller_for(beta).may_use(models["e5"])
    assert not caller_for(beta).may_use(models["minilm"])
    # Beta's restriction does not narrow alpha.
    assert caller_for(alpha).may_use(models["minilm"])


def test_restricted_tenant_with_no_models_sees_none(models):
    gamma = tenant_create(name="Gamma", allow_all_models=False)
    assert models_for(gamma) == []
    assert not caller_for(gamma).may_use(models["minilm"])


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
    assert resolve(name="minilm") == model


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


def test_the_bundled_model_ranks_from_its_first_registration_until_turned_off(db, tmp_path):
    write_finished_export(tmp_path, max_tokens=256)
    model = embedding_model_register_local(repository=tmp_path)
    assert (model.task, model.rerank_by_similarity, model.ranks) == ("embed", True, True)
    model.rerank_by_similarity = False
    model.save(update_fields=["rerank_by_similarity"])
    # Setup registers it again at every run: the operator's choice stays.
    assert embedding_model_register_local(repository=tmp_path).rerank_by_similarity is False


def test_only_an_embedding_model_ranks_by_similarity(db, tmp_path):
    write_finished_export(tmp_path, max_tokens=256)
    registered = catalog.embedding_model_register(triton_model="minilm", name="plain", repository=tmp_path)
    assert registered.rerank_by_similarity is False  # a new model ranks only if asked
    export_json = tmp_path / "minilm" / "1" / "export.json"
    export_json.write_text(export_json.read_text().replace("{", '{"task": "rerank", ', 1))
    reranker = catalog.embedding_model_register(triton_model="minilm", name="cross", repository=tmp_path)
    # An export that records no activation (from before they were recorded): its logit is the score.
    assert (reranker.task, reranker.ranks, reranker.score_activation) == ("rerank", True, "identity")
    assert registered.score_activation == ""
    export_json.write_text(export_json.read_text().replace("{", '{"activation": "sigmoid", ', 1))
    reranker = catalog.embedding_model_register(triton_model="minilm", name="cross", repository=tmp_path)
    assert reranker.score_activation == "sigmoid"
    with pytest.raises(CatalogError, match="only an embedding model ranks by similarity"):
        catalog.embedding_model_register(
            triton_model="minilm", name="cross", rerank_by_similarity=True, repository=tmp_path
        )


# export.json's records of a variant's agreement with its float32 graph (abridged).
VARIANT_RECORDS = {
    "int8": {
        "method": "dynamic",
        "min_cosine": 0.991,
        "mean_cosine": 0.996,
        "recall_at_10": 0.921,
        "text_count": 500,
    },
    "float16": {
        "method": "onnxruntime.transformers",
        "min_cosine": 0.999999,
        "mean_cosine": 0.9999995,
        "recall_at_10": 0.999,
        "text_count": 500,
    },
}


def write_variant_export(repository, *, version: int, dtype: str) -> None:
    record = {dtype: VARIANT_RECORDS[dtype]} if dtype in VARIANT_RECORDS else {}
    write_finished_export(repository, version=version, extra={"dtype": dtype, **record})


def test_a_dtype_pins_the_newest_export_of_it_and_a_second_name_serves_the_other(db, tmp_path):
    # 1 float32 (no "dtype": made before int8 existed), 2 int8, 3 float32, 4 int8, 5 float32, 6 float16.
    write_finished_export(tmp_path, version=1)
    for version, dtype in ((2, "int8"), (3, "float32"), (4, "int8"), (5, "float32"), (6, "float16")):
        write_variant_export(tmp_path, version=version, dtype=dtype)
    register = catalog.embedding_model_register

    model = register(triton_model="minilm", name="mini", version=1, repository=tmp_path)
    assert (
        register(triton_model="minilm", name="mini", dtype="int8", repository=tmp_path).triton_version == "4"
    )
    # Registering again without a dtype keeps the pin; a dtype moves it.
    assert register(triton_model="minilm", name="mini", repository=tmp_path).triton_version == "4"
    model = register(triton_model="minilm", name="mini", dtype="float32", repository=tmp_path)
    assert (model.triton_version, model.dimensions) == ("5", 384)
    # Side by side: a second catalog name on the int8 version of the same Triton model.
    both = register(triton_model="minilm", name="mini-int8", dtype="int8", repository=tmp_path)
    assert both.triton_version == "4" and EmbeddingModel.objects.get(name="mini").triton_version == "5"
    assert register(triton_model="minilm", name="old", version=2, dtype="int8", repository=tmp_path)
    # A third name on the float16 version, the newest export, which no other name moved to.
    assert (
        register(triton_model="minilm", name="mini-gpu", dtype="float16", repository=tmp_path).triton_version
        == "6"
    )
    assert EmbeddingModel.objects.get(name="mini").triton_version == "5"
    with pytest.raises(CatalogError, match="minilm version 3 is a float32 export, not int8"):
        register(triton_model="minilm", name="mini", version=3, dtype="int8", repository=tmp_path)
    with pytest.raises(CatalogError, match="minilm version 4 is an int8 export, not float16"):
        register(triton_model="minilm", name="mini", version=4, dtype="float16", repository=tmp_path)
    with pytest.raises(CatalogError, match="dtype must be one of float32, int8, float16, not 'int4'"):
        register(triton_model="minilm", name="mini", dtype="int4", repository=tmp_path)


def test_the_served_dtype_and_a_variants_agreement_with_float32_are_reported(db, tmp_path):
    write_finished_export(tmp_path, version=1)  # no "dtype": made before int8 existed
    write_variant_export(tmp_path, version=2, dtype="int8")
    write_variant_export(tmp_path, version=3, dtype="float16")
    write_finished_export(tmp_path, version=4, extra={"dtype": "float16"})  # its record lost
    served = {
        version: catalog.embedding_model_dtype(
            model=catalog.embedding_model_register(
                triton_model="minilm", name=f"v{version}", version=version, repository=tmp_path
            ),
            repository=tmp_path,
        )
        for version in (1, 2, 3, 4)
    }
    assert served[1] == {"dtype": "float32", "agreement": None}
    for version, dtype in ((2, "int8"), (3, "float16")):
        figures = {key: value for key, value in VARIANT_RECORDS[dtype].items() if key != "method"}
        assert served[version] == {"dtype": dtype, "agreement": {"reference": "float32", **figures}}
    assert served[4] == {"dtype": "float16", "agreement": None}
    (tmp_path / "minilm" / "3" / "export.json").unlink()  # gone: nothing to report
    model = EmbeddingModel.objects.get(name="v3")
    assert catalog.embedding_model_dtype(model=model, repository=tmp_path) == {
        "dtype": None,
        "agreement": None,
    }


def test_a_dtype_with_no_export_of_it_is_refused_naming_the_export_command(db, tmp_path):
    write_finished_export(tmp_path, version=1)
    with pytest.raises(
        CatalogError,
        match=r"minilm has no finished int8 export \(finished versions: 1\); export one first "
        r"\(manage.py export_model --name minilm --dtype int8\)",
    ):
        catalog.embedding_model_register(triton_model="minilm", dtype="int8", repository=tmp_path)
    assert not EmbeddingModel.objects.exists()


def test_a_rerank_request_naming_no_model_prefers_a_rerank_model_then_the_default(models, settings):
    settings.MODEL_CACHE_SECONDS = 0
    everything = Caller(1, 1, allow_all_models=True)
    default = async_to_sync(catalog.rerank_model_default)
    assert default(caller=everything) is None  # nothing ranks
    EmbeddingModel.objects.filter(name__in=["all-MiniLM-L6-v2", "e5-small"]).update(rerank_by_similarity=True)
    assert default(caller=everything).name == "all-MiniLM-L6-v2"  # settings.DEFAULT_EMBEDDING_MODEL
    EmbeddingModel.objects.create(
        name="z-reranker", task="rerank", triton_model="z", dimensions=1, max_tokens=512
    )
    assert default(caller=everything).name == "z-reranker"
    only_e5 = Caller(1, 1, allowed_model_ids=frozenset({models["e5"].pk}))
    assert default(caller=only_e5).name == "e5-small"


def test_a_models_variant_is_its_pinned_version_and_that_exports_dtype(db, tmp_path, settings):
    settings.TRITON_MODEL_REPOSITORY = str(tmp_path)
    write_finished_export(tmp_path, version=1)  # no "dtype": exported before int8, float32
    # Any dtype export.json records (float16 is not one register_model knows yet).
    for version, dtype in ((2, "int8"), (3, "float16"), (4, "in|t8"), (5, ["int8"])):
        write_finished_export(tmp_path, version=version, extra={"dtype": dtype})
    embedding_model_cache_clear()

    def variant(version: str) -> tuple[str, str]:
        model = EmbeddingModel(
            name="m", triton_model="minilm", triton_version=version, dimensions=1, max_tokens=1
        )
        found = catalog.embedding_model_variant(model=model)
        return found.version, found.dtype

    assert [variant(v) for v in ("1", "2", "3")] == [("1", "float32"), ("2", "int8"), ("3", "float16")]
    # A dtype no usage row could hold, an export gone, no pinned version: what is known, no more.
    assert [variant(v) for v in ("4", "5", "9", "")] == [("4", ""), ("5", ""), ("9", ""), ("", "")]


def test_a_requests_variant_is_remembered_with_the_catalog_and_no_file_is_read_for_it(
    db, tmp_path, settings, monkeypatch
):
    settings.TRITON_MODEL_REPOSITORY = str(tmp_path)
    settings.MODEL_CACHE_SECONDS = 3600
    write_finished_export(tmp_path, version=1)
    write_finished_export(tmp_path, version=2, extra={"dtype": "int8"})
    EmbeddingModel.objects.create(
        name="m", triton_model="minilm", triton_version="1", dimensions=384, max_tokens=256
    )
    embedding_model_cache_clear()
    model = resolve(name="m")  # what a request does first: the catalog's read remembers the variant
    reads = []
    read_text = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda path, *a, **k: reads.append(path) or read_text(path, *a, **k)
    )

    assert catalog.embedding_model_variant(model=model) == catalog.ModelVariant("1", "float32")
    assert reads == []
    # Switched to the int8 version: the next catalog read (register_model clears it) knows it.
    EmbeddingModel.objects.filter(name="m").update(triton_version="2")
    embedding_model_cache_clear()
    switched = resolve(name="m")
    assert len(reads) == 1
    assert catalog.embedding_model_variant(model=switched) == catalog.ModelVariant("2", "int8")
    assert len(reads) == 1
    # A model the catalog's read does not hold (a disabled one, a job's in a worker): read once,
    # then remembered for MODEL_CACHE_SECONDS, as the catalog's rows are.
    disabled = EmbeddingModel(name="d", triton_model="minilm", triton_version="1", dimensions=1, max_tokens=1)
    for _ in range(3):
        assert catalog.embedding_model_variant(model=disabled) == catalog.ModelVariant("1", "float32")
    assert len(reads) == 2
    settings.MODEL_CACHE_SECONDS = 0
    catalog.embedding_model_variant(model=disabled)
    assert len(reads) == 3
