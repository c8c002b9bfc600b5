"""OpenAI's Files API: files kept in the "files" storage (STORAGES["files"]), their facts in StoredFile.

The bytes go through Django's storage API, so they live wherever FILES_STORAGE_BACKEND puts them (a
directory every web and worker process shares by default, object storage a setting away) and
survive any process's restart. A file is written under a fresh random name and its row saved only
once it is whole, so a reader never sees half a file; deleting removes the row first, then the
bytes once that is committed (a failure in between leaves bytes nobody can name, never a row
without bytes).
"""

from __future__ import annotations

import logging
import re
import secrets
import string
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import IO

from django.core.files import File
from django.core.files.storage import Storage, storages
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from embeddings.errors.service import EmptyFile, ObjectNotFound
from embeddings.models import StoredFile
from embeddings.services.pages import creation_page

logger = logging.getLogger(__name__)

PUBLIC_ID_ALPHABET = string.ascii_letters + string.digits
# Every id _new_public_id draws: any other string names no file, and is not looked up (PostgreSQL
# refuses a query with a NUL in it).
FILE_ID_PATTERN = r"file-[A-Za-z0-9]{24}"
READ_PIECE_BYTES = 256 * 1024


def files_storage() -> Storage:
    return storages["files"]


def _new_public_id() -> str:
    return "file-" + "".join(secrets.choice(PUBLIC_ID_ALPHABET) for _ in range(24))


def _storage_name(tenant_id: int, public_id: str) -> str:
    # Tenant and id only: a client's file name never becomes a path.
    return f"tenant-{tenant_id}/{public_id}"


def has_a_line(content: IO[bytes]) -> bool:
    """Whether `content`, read from where it is, has a line that is not blank (a batch's requests
    are its lines that are not blank, as batch validation reads them)."""
    while piece := content.read(READ_PIECE_BYTES):
        if piece.strip():
            return True
    return False


def file_create(
    *,
    tenant_id: int,
    purpose: str,
    filename: str,
    content: IO[bytes],
    expires_at: datetime | None = None,
) -> StoredFile:
    """Store `content` (a binary file object, read a piece at a time, seekable) as a new file of the
    tenant. A batch input file without a line is refused (EmptyFile): no batch could run it."""
    if purpose == StoredFile.Purpose.BATCH:
        start = content.tell()
        if not has_a_line(content):
            raise EmptyFile("The file has no lines; a batch input file has one request a line.", param="file")
        content.seek(start)
    public_id = _new_public_id()
    storage = files_storage()
    name = storage.save(_storage_name(tenant_id, public_id), File(content))
    try:
        return StoredFile.objects.create(
            public_id=public_id,
            tenant_id=tenant_id,
            purpose=purpose,
            filename=filename[:255],
            bytes=storage.size(name),
            storage_name=name,
            expires_at=expires_at,
        )
    except BaseException:
        storage.delete(name)
        raise


def file_for_tenant(*, tenant_id: int, public_id: str) -> StoredFile | None:
    """The tenant's live file with this id; None for an unknown, expired or another tenant's id."""
    if not re.fullmatch(FILE_ID_PATTERN, public_id):
        return None
    return (
        StoredFile.objects.filter(tenant_id=tenant_id, public_id=public_id)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
        .first()
    )


def file_of_tenant(*, tenant_id: int, public_id: str) -> StoredFile:
    """The tenant's live file with this id; ObjectNotFound (404 file_not_found) for any other id."""
    stored = file_for_tenant(tenant_id=tenant_id, public_id=public_id)
    if stored is None:
        raise ObjectNotFound(f"You have no file {public_id!r}.", param="file_id", code="file_not_found")
    return stored


def files_for_tenant(
    *, tenant_id: int, purpose: str | None, limit: int, order: str, after: str | None
) -> tuple[list[StoredFile], bool]:
    """A page of the tenant's live files by creation time (`order` "asc" or "desc"), after the
    file `after`; has_more."""
    files = StoredFile.objects.filter(tenant_id=tenant_id).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    )
    if purpose:
        files = files.filter(purpose=purpose)
    return creation_page(
        files, tenant_id=tenant_id, limit=limit, after=after, what="file", newest_first=order == "desc"
    )


def file_open(stored: StoredFile) -> IO[bytes]:
    return files_storage().open(stored.storage_name, "rb")


def file_pieces(stored: StoredFile) -> Iterator[bytes]:
    """The file's bytes, READ_PIECE_BYTES at a time (for a streamed download)."""
    with file_open(stored) as handle:
        while piece := handle.read(READ_PIECE_BYTES):
            yield piece


def file_delete(*, stored: StoredFile) -> None:
    """Delete the row, then the bytes: once the row's deletion is committed (at once outside a
    transaction; after the admin's delete view commits inside one), so a rollback never leaves a
    row without bytes."""
    StoredFile.objects.filter(pk=stored.pk).delete()
    transaction.on_commit(lambda: _bytes_delete(stored))


def _bytes_delete(stored: StoredFile) -> None:
    try:
        files_storage().delete(stored.storage_name)
    except OSError as error:  # the row is gone: nobody can reach the bytes any more
        logger.warning("file %s: bytes not deleted: %s", stored.public_id, error)


def files_expire_due(*, now: datetime | None = None) -> int:
    """Delete every file past its expires_at; how many."""
    now = now or timezone.now()
    expired = 0
    for stored in StoredFile.objects.filter(expires_at__lte=now).iterator():
        file_delete(stored=stored)
        expired += 1
    return expired


def expires_after_seconds(seconds: int | None, *, now: datetime | None = None) -> datetime | None:
    if seconds is None:
        return None
    return (now or timezone.now()) + timedelta(seconds=seconds)


def file_object(stored: StoredFile) -> dict:
    """The API representation of a file (OpenAI's FileObject)."""
    return {
        "id": stored.public_id,
        "object": "file",
        "bytes": stored.bytes,
        "created_at": int(stored.created_at.timestamp()),
        "expires_at": None if stored.expires_at is None else int(stored.expires_at.timestamp()),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
        "status_details": None,
    }
