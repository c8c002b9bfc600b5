"""API keys: `emb_<public id>_<secret>`; stored as the public id and an HMAC-SHA256 of the secret."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import re
import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from embeddings.models import ApiKey, Tenant

KEY_PREFIX = "emb_"
PUBLIC_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
PUBLIC_ID_LENGTH = 12
SECRET_BYTES = 32
KEY_PUBLIC_ID_PATTERN = r"[a-z0-9]{12}"
# The public id has no "_", so the first "_" after it splits the key unambiguously; the secret is
# url-safe base64 and may itself contain "_" or "-".
KEY_PATTERN = re.compile(
    rf"{KEY_PREFIX}(?P<public_id>{KEY_PUBLIC_ID_PATTERN})_(?P<secret>[A-Za-z0-9_-]{{20,100}})"
)
LAST_USED_RESOLUTION = timedelta(minutes=1)


def _secret_hash(secret: str) -> str:
    return hmac.new(settings.API_KEY_HMAC_SECRET.encode(), secret.encode(), hashlib.sha256).hexdigest()


def parse_api_key(key: str) -> tuple[str, str] | None:
    """(public id, secret) of a well-formed key, else None."""
    # fullmatch, not match with "$": "$" also matches before a trailing newline.
    match = KEY_PATTERN.fullmatch(key)
    return (match["public_id"], match["secret"]) if match else None


# Public ids drawn before giving up: at 36^12 ids a second draw is already all but never needed.
PUBLIC_ID_ATTEMPTS = 5


def new_public_id() -> str:
    return "".join(secrets.choice(PUBLIC_ID_ALPHABET) for _ in range(PUBLIC_ID_LENGTH))


def api_key_create(*, tenant: Tenant, name: str, expires_at: datetime | None = None) -> tuple[ApiKey, str]:
    """A new key for `tenant`; the full key is returned once here and never stored.

    The unique public id is claimed by the INSERT itself, not by a look-up first (a concurrent
    creation could take the id in between), inside a savepoint: on PostgreSQL a failed INSERT would
    otherwise abort the caller's transaction (the admin saves inside one).
    """
    secret = secrets.token_urlsafe(SECRET_BYTES)
    for attempt in itertools.count(1):
        public_id = new_public_id()
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    tenant=tenant,
                    name=name,
                    public_id=public_id,
                    secret_hash=_secret_hash(secret),
                    expires_at=expires_at,
                )
        except IntegrityError:
            if attempt >= PUBLIC_ID_ATTEMPTS or not ApiKey.objects.filter(public_id=public_id).exists():
                raise  # not the public id: another constraint, reported as it is
        else:
            return api_key, f"{KEY_PREFIX}{public_id}_{secret}"


def api_key_revoke(*, api_key: ApiKey, now: datetime | None = None) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = now or timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


def api_key_for_secret(*, key: str) -> ApiKey | None:
    """The key whose secret this is (revoked and expired ones included: callers say why they refuse)."""
    parsed = parse_api_key(key)
    if parsed is None:
        return None
    public_id, secret = parsed
    # Hash before the lookup so an unknown public id costs the same as a wrong secret.
    presented_hash = _secret_hash(secret)
    api_key = ApiKey.objects.select_related("tenant").filter(public_id=public_id).first()
    if api_key is None or not hmac.compare_digest(api_key.secret_hash, presented_hash):
        return None
    return api_key


def api_key_touch(*, api_key_id: int, now: datetime | None = None) -> bool:
    """Record use, at most once a minute per key: one conditional UPDATE, cheap and race-free."""
    now = now or timezone.now()
    stale = Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - LAST_USED_RESOLUTION)
    return ApiKey.objects.filter(Q(pk=api_key_id) & stale).update(last_used_at=now) == 1
