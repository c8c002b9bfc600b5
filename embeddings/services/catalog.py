"""The embedding models clients can name: lookup (cached per process), listing, local registration."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.conf import settings

from embeddings.models import EmbeddingModel, Tenant

if TYPE_CHECKING:
    from embeddings.api.authentication import ApiPrincipal

LOCAL_MODEL_NAME = "all-MiniLM-L6-v2"
LOCAL_MODEL_ALIASES = ["minilm", "sentence-transformers/all-MiniLM-L6-v2"]

_enabled_cache: tuple[float, tuple[EmbeddingModel, ...]] | None = None


def embedding_models_enabled() -> tuple[EmbeddingModel, ...]:
    return tuple(EmbeddingModel.objects.filter(enabled=True).order_by("name"))


def embedding_model_for_name(*, name: str) -> EmbeddingModel | None:
    """An enabled model by its name or one of its aliases."""
    return next((model for model in embedding_models_enabled() if model.answers_to(name)), None)


def embedding_models_for_tenant(*, tenant: Tenant) -> list[EmbeddingModel]:
    """The enabled models `tenant` may use (all of them unless the tenant is restricted)."""
    models = EmbeddingModel.objects.filter(enabled=True).order_by("name")
    if not tenant.allow_all_models:
        models = models.filter(pk__in=tenant.allowed_models.values("pk"))
    return list(models)


async def _enabled_cached() -> tuple[EmbeddingModel, ...]:
    # Every request names a model: read the few rows once every MODEL_CACHE_SECONDS, not per request.
    global _enabled_cache
    now = time.monotonic()
    if _enabled_cache is None or now - _enabled_cache[0] > settings.MODEL_CACHE_SECONDS:
        _enabled_cache = (now, await sync_to_async(embedding_models_enabled)())
    return _enabled_cache[1]


def embedding_model_cache_clear() -> None:
    global _enabled_cache
    _enabled_cache = None


async def embedding_model_resolve(*, name: str) -> EmbeddingModel | None:
    """`embedding_model_for_name` from the per-process cache, for the request path."""
    return next((model for model in await _enabled_cached() if model.answers_to(name)), None)


async def embedding_models_for_principal(*, principal: ApiPrincipal) -> list[EmbeddingModel]:
    return [model for model in await _enabled_cached() if principal.may_use(model)]


def embedding_model_register_local(*, repository: Path, triton_model: str = "minilm") -> EmbeddingModel:
    """Register (idempotently) the model `export_model` wrote, so a first run can serve it."""
    export_info_path = Path(repository) / triton_model / "1" / "export.json"
    if not export_info_path.exists():
        raise FileNotFoundError(
            f"{export_info_path} is missing: export the model first (manage.py export_model)"
        )
    export_info = json.loads(export_info_path.read_text())
    model, _ = EmbeddingModel.objects.update_or_create(
        name=LOCAL_MODEL_NAME,
        defaults={
            "aliases": LOCAL_MODEL_ALIASES,
            "triton_model": triton_model,
            "dimensions": int(export_info["dims"]),
            "max_tokens": int(export_info["max_tokens"]),
        },
    )
    embedding_model_cache_clear()
    return model
