"""Tenants: creation, deactivation, and which models they may use."""

from __future__ import annotations

from django.utils.text import slugify

from embeddings.models import EmbeddingModel, Tenant


def tenant_create(*, name: str, slug: str | None = None, allow_all_models: bool = True) -> Tenant:
    slug = slug or slugify(name)
    if not slug:
        raise ValueError(f"cannot make a slug from {name!r}; pass one")
    return Tenant.objects.create(name=name, slug=slug, allow_all_models=allow_all_models)


def tenant_deactivate(*, tenant: Tenant) -> Tenant:
    if tenant.is_active:
        tenant.is_active = False
        tenant.save(update_fields=["is_active"])
    return tenant


def tenant_may_use_model(*, tenant: Tenant, model: EmbeddingModel) -> bool:
    return tenant.allow_all_models or tenant.allowed_models.filter(pk=model.pk).exists()
