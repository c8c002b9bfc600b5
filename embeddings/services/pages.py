"""One page of a tenant's objects by creation time after a cursor, as OpenAI lists them (`after`,
`limit`, `has_more`): the lists of jobs, files and batches."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from embeddings.errors.service import ObjectNotFound


def creation_page(
    objects: QuerySet, *, tenant_id: int, limit: int, after: str | None, what: str, newest_first: bool = True
) -> tuple[list, bool]:
    """`limit` of `objects` in creation order (ties by id) after the tenant's object `after` (a
    public id; another tenant's or an unknown one is ObjectNotFound, a 404 naming `what`, as the
    same id in a path is), and whether more follow."""
    objects = objects.order_by(*(("-created_at", "-id") if newest_first else ("created_at", "id")))
    if after:
        cursor = objects.model.objects.filter(tenant_id=tenant_id, public_id=after).first()
        if cursor is None:
            raise ObjectNotFound(
                f"You have no {what} {after!r} to list after.", param="after", code=f"{what}_not_found"
            )
        if newest_first:
            beyond = Q(created_at__lt=cursor.created_at) | Q(created_at=cursor.created_at, id__lt=cursor.pk)
        else:
            beyond = Q(created_at__gt=cursor.created_at) | Q(created_at=cursor.created_at, id__gt=cursor.pk)
        objects = objects.filter(beyond)
    page = list(objects[: limit + 1])
    return page[:limit], len(page) > limit
