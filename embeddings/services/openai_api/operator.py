"""What an operator may do to a batch or a file (the admin's actions call these, as the API calls the
rest of this package), and what the admin reads to say what an action would do:

    batch_cancel_refusal      why a batch cannot be cancelled now (None when it can)
    batch_cancel_by_operator  the API's batch_cancel, for a validating or in-progress batch, its
                              job's history naming who asked; refused with BatchActionRefused,
                              saying why, for any other
    files_uses                the batches that name each of some files as input, output or error
                              file (one query, however many files), and what deleting the file
                              does to each
    file_delete_by_operator   the API's file_delete, returning those uses as they were
    file_download_refusal     why a file's bytes cannot be read now (expired, missing), or None

Deleting a file keeps the API's semantics: the batches keep their rows, a finished batch's
output_file_id or error_file_id becomes null (the foreign key is SET_NULL), a validating batch whose
input file is gone fails (file_not_found), a batch past validation has its lines in its job already.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from django.db.models import Q
from django.utils import timezone

from embeddings.errors.service import BatchActionRefused
from embeddings.models import Batch, StoredFile
from embeddings.services.openai_api.batches import CANCELLABLE, batch_cancel
from embeddings.services.openai_api.files import file_delete, files_storage

Status = Batch.Status
# The roles a file plays in a batch, by the batch's foreign key.
FILE_ROLES = (("input", "input_file_id"), ("output", "output_file_id"), ("error", "error_file_id"))


def batch_cancel_refusal(batch: Batch) -> str | None:
    """Why `batch` (as read) cannot be cancelled now, or None."""
    if batch.status in CANCELLABLE:
        return None
    if batch.status == Status.CANCELLING:
        return "it is cancelling already: it stops once its running chunks have"
    if batch.status == Status.FINALIZING:
        return "it is finalizing: its job has ended and its output and error files are being written"
    return f"it is {batch.status}: there is nothing to cancel"


def batch_cancel_by_operator(*, batch: Batch, actor: str = "") -> Batch:
    """Cancel a validating or in-progress batch as its client may (batch_cancel): cancelling, then
    cancelled once its running chunks have stopped, what finished in its output file and the rest
    in its error file (batch_cancelled). Refused, saying why, for any other."""
    fresh = Batch.objects.select_related("job").filter(pk=batch.pk).first()
    if fresh is None:
        raise BatchActionRefused(f"Batch {batch.public_id} no longer exists.")
    if refusal := batch_cancel_refusal(fresh):
        raise BatchActionRefused(f"Batch {fresh.public_id}: {refusal}.")
    cancelled = batch_cancel(batch=fresh, actor=actor)
    if cancelled.status not in (Status.CANCELLING, Status.CANCELLED):
        # Its status moved on between the read and the conditional UPDATE (it finished).
        raise BatchActionRefused(f"Batch {fresh.public_id} is {cancelled.status} now: nothing was cancelled.")
    return cancelled


@dataclass(frozen=True)
class FileUse:
    """One batch naming a file: as its `role` (input, output or error)."""

    batch: Batch
    role: str

    @property
    def deletion_effect(self) -> str:
        """What deleting the file does to the batch (the API's semantics)."""
        batch = self.batch
        if self.role == "output":
            return (
                f"its output_file_id becomes null (its {batch.completed:,} answered lines go with the file)"
            )
        if self.role == "error":
            return f"its error_file_id becomes null (its {batch.failed:,} failed lines go with the file)"
        if batch.status == Status.VALIDATING:
            return "it fails (file_not_found) unless its validation has read the file already"
        return "nothing changes: it has read its lines already (input_file_id names a file that is gone)"


def files_uses(files: Iterable[StoredFile]) -> dict[int, list[FileUse]]:
    """For each of `files` (by primary key), the batches naming it, newest first; one query."""
    ids = {stored.pk for stored in files}
    uses: dict[int, list[FileUse]] = {file_id: [] for file_id in ids}
    if not ids:
        return uses
    named = Q(input_file_id__in=ids) | Q(output_file_id__in=ids) | Q(error_file_id__in=ids)
    fields = ("public_id", "status", "completed", "failed", "created_at", *(field for _, field in FILE_ROLES))
    batches = Batch.objects.filter(named).only(*fields).order_by("-created_at", "-pk")
    for batch in batches:
        for role, field in FILE_ROLES:
            if (file_id := getattr(batch, field)) in ids:
                uses[file_id].append(FileUse(batch=batch, role=role))
    return uses


def file_delete_by_operator(*, stored: StoredFile) -> list[FileUse]:
    """Delete a file as its client may (file_delete: the row, then its bytes once that is committed);
    the batches that named it, as they were."""
    uses = files_uses([stored])[stored.pk]
    file_delete(stored=stored)
    return uses


def file_download_refusal(stored: StoredFile, *, now: datetime | None = None) -> str | None:
    """Why the file's bytes are not to be read now, or None: an expired file is not served (it is
    deleted at the next sweep, and the API no longer serves it either), nor one whose bytes are
    missing from the files storage."""
    now = now or timezone.now()
    if stored.expires_at is not None and stored.expires_at <= now:
        return f"it expired at {stored.expires_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
    if not files_storage().exists(stored.storage_name):
        return "its bytes are not in the files storage"
    return None
