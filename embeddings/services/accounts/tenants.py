"""Tenants: creation, deactivation, which models they may use, and their webhook signing secrets."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone
from django.utils.text import slugify

from embeddings.models import ApiKey, Tenant
from embeddings.services.accounts.encryption import secret_decrypt, secret_encrypt

WEBHOOK_SECRET_PREFIX = "whsec_"
WEBHOOK_SECRET_BYTES = 32


def tenant_create(
    *,
    name: str,
    slug: str | None = None,
    allow_all_models: bool = True,
    job_storage_budget_bytes: int | None = None,
) -> Tenant:
    """A new tenant; job_storage_budget_bytes None: JOB_STORAGE_TENANT_BUDGET_BYTES."""
    slug = slug or slugify(name)
    if not slug:
        raise ValueError(f"cannot make a slug from {name!r}; pass one")
    if job_storage_budget_bytes is not None and job_storage_budget_bytes < 0:
        raise ValueError(f"job storage budget must be at least 0 bytes, not {job_storage_budget_bytes}")
    return Tenant.objects.create(
        name=name,
        slug=slug,
        allow_all_models=allow_all_models,
        job_storage_budget_bytes=job_storage_budget_bytes,
    )


def tenant_deactivate(*, tenant: Tenant) -> Tenant:
    if tenant.is_active:
        tenant.is_active = False
        tenant.save(update_fields=["is_active"])
    return tenant


def quota_limits_update(*, owner: Tenant | ApiKey, limits: dict[str, int | None]) -> None:
    """Set some of a tenant's (or key's) quota limits; None removes a limit. Takes effect in
    serving processes within API_KEY_CACHE_SECONDS."""
    unknown = set(limits) - set(owner.QUOTA_FIELDS)
    if unknown:
        raise ValueError(f"not quota limits: {', '.join(sorted(unknown))}")
    for name, value in limits.items():
        setattr(owner, name, value)
    # Raises ValidationError (a burst without its rate, a rate below 1) before anything is saved.
    owner.clean_fields(
        exclude=[field.name for field in owner._meta.fields if field.name not in owner.QUOTA_FIELDS]
    )
    owner.clean()
    owner.save(update_fields=list(limits))


# --- Webhook signing secrets ------------------------------------------------------------------------
# Each tenant signs its callbacks with its own secret, so one tenant's receiver can neither verify
# nor forge another's. Stored encrypted (services/accounts/encryption.py), not hashed: the server must
# recompute the HMAC. The plaintext is returned once, by the rotation that makes it.


def _new_webhook_secret() -> str:
    return WEBHOOK_SECRET_PREFIX + secrets.token_urlsafe(WEBHOOK_SECRET_BYTES)


def webhook_secret_fingerprint(secret: str) -> str:
    """A short, non-secret name for a secret (first 12 hex digits of its SHA-256), to tell which
    one a receiver holds."""
    return hashlib.sha256(secret.encode()).hexdigest()[:12]


def tenant_webhook_secret_rotate(
    *, tenant: Tenant, overlap: timedelta = timedelta(0), now: datetime | None = None
) -> str:
    """A new signing secret for `tenant`, returned once. For `overlap` the current one keeps
    signing beside it (both `v1` values in each header); with no overlap it stops at once. A
    rotation during an overlap ends the older secret's window: at most two secrets sign."""
    if overlap < timedelta(0):
        raise ValueError("the overlap cannot be negative")
    now = now or timezone.now()
    secret = _new_webhook_secret()
    with transaction.atomic():
        locked = Tenant.objects.select_for_update().get(pk=tenant.pk)
        keep_current = bool(locked.webhook_secret_encrypted) and overlap > timedelta(0)
        locked.webhook_previous_secret_encrypted = locked.webhook_secret_encrypted if keep_current else ""
        locked.webhook_previous_secret_expires_at = now + overlap if keep_current else None
        locked.webhook_secret_encrypted = secret_encrypt(secret)
        locked.webhook_secret_created_at = now
        fields = [
            "webhook_secret_encrypted",
            "webhook_secret_created_at",
            "webhook_previous_secret_encrypted",
            "webhook_previous_secret_expires_at",
        ]
        locked.save(update_fields=fields)
    for field in fields:
        setattr(tenant, field, getattr(locked, field))
    return secret


def tenant_webhook_signing_secrets(*, tenant: Tenant, now: datetime | None = None) -> list[str]:
    """The secrets that sign the tenant's callbacks now: the current one, then the previous one
    while its overlap lasts. A tenant without one gets one here (lazily, at its first callback;
    the operator shows it by rotating). Raises SecretUndecryptable if SECRET_KEY changed without
    a fallback."""
    now = now or timezone.now()
    if not tenant.webhook_secret_encrypted:
        # Conditional: two workers signing the tenant's first callbacks at once create one secret.
        Tenant.objects.filter(pk=tenant.pk, webhook_secret_encrypted="").update(
            webhook_secret_encrypted=secret_encrypt(_new_webhook_secret()), webhook_secret_created_at=now
        )
        tenant.refresh_from_db(fields=["webhook_secret_encrypted", "webhook_secret_created_at"])
    signing = [secret_decrypt(tenant.webhook_secret_encrypted)]
    expires_at = tenant.webhook_previous_secret_expires_at
    if tenant.webhook_previous_secret_encrypted and expires_at is not None and now < expires_at:
        signing.append(secret_decrypt(tenant.webhook_previous_secret_encrypted))
    return signing
