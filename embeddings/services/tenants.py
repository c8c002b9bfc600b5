"""Tenants: creation, deactivation, and which models they may use."""

from __future__ import annotations

from django.utils.text import slugify

from embeddings.models import ApiKey, EmbeddingModel, Tenant


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


def quota_limits_update(*, owner: Tenant | ApiKey, limits: dict[str, int | None]) -> None:
    """Set some of a tenant's (or key's) quota limits; None removes a limit. Takes effect in
    serving processes within API_KEY_CACHE_SECONDS."""
    unknown = set(limits) - set(owner.QUOTA_FIELDS)
    if unknown:
        raise ValueError(f"not quota limits: {', '.join(sorted(unknown))}")
    for name, value in limits.items():
        setattr(owner, name, value)
    owner.save(update_fields=list(limits))
