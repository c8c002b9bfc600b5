"""One page of a tenant's objects by creation time after a cursor, as OpenAI lists them (`after`,
`limit`, `has_more`): the lists of jobs, files and batches."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from embeddings.services.errors import InvalidRequest


def creation_page(
    objects: QuerySet, *, tenant_id: int, limit: int, after: str | None, what: str, newest_first: bool = True
) -> tuple[list, bool]:
    """`limit` of `objects` in creation order (ties by id) after the tenant's object `after` (a
    public id; another tenant's or an unknown one is a 400 naming `what`), and whether more follow."""
    objects = objects.order_by(*(("-created_at", "-id") if newest_first else ("created_at", "id")))
    if after:
        cursor = objects.model.objects.filter(tenant_id=tenant_id, public_id=after).first()
        if cursor is None:
            raise InvalidRequest(f"No {what} {after!r} to list after", param="after")
        if newest_first:
            beyond = Q(created_at__lt=cursor.created_at) | Q(created_at=cursor.created_at, id__lt=cursor.pk)
        else:
            beyond = Q(created_at__gt=cursor.created_at) | Q(created_at=cursor.created_at, id__gt=cursor.pk)
        objects = objects.filter(beyond)
    page = list(objects[: limit + 1])
    return page[:limit], len(page) > limit
