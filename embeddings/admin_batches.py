"""The admin's batches and files (OpenAI's Batch and Files APIs): lists an operator scans (filters by
tenant, status, endpoint, model, purpose, date and expiry; progress bars, request counts, tokens,
links between a batch, its job and its files) and their pages (a batch's validation errors, files
and timeline; a file's size, expiry, download and the batches that name it), with two actions:
cancel a batch and delete a file, through embeddings/services/openai_api/operator.py, which calls
the API's own batch_cancel and file_delete.

Thin, as the rest of the admin: every action is one service call; what it did goes to the admin's
history (LogEntry) and to a message. Batches and files are made through the API only: no adding or
editing here, and batches are not deleted (their files are). Staff who may only view see every page
and may download a file (reading a tenant's file is viewing it: the view permission is enough), but
see no action, and a POSTed action is refused with 403. The lists read no Redis and make the same
few queries whatever the page holds (a batch's tenant, job and files are joined; the batches naming
a page of files are read in one query).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseNotFound,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import content_disposition_header
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince, timeuntil

from embeddings.admin_jobs import progress_bar, rows_done
from embeddings.admin_operator import REFUSALS_LISTED, ActionOutcome, OperatorPagesAdmin, StatusFilter
from embeddings.models import Batch, EmbeddingModel, StoredFile

# The Batch and Files services (Celery, the job engine) are imported by the views that use them,
# not here: every process imports the admin at start-up (admin.py says so).
if TYPE_CHECKING:
    from embeddings.services.openai_api.batches import BatchCounts
    from embeddings.services.openai_api.operator import FileUse

Status = Batch.Status
ACTIVE = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)
# A batch's page lists this many of its kept validation errors (every one is in its error file).
ERRORS_SHOWN = 200
# A file's row in the list names this many of the batches using it, then counts the rest.
USES_LISTED = 3
TIMELINE = (
    ("created_at", "created (validating)"),
    ("in_progress_at", "in progress (validated, its job started)"),
    ("cancelling_at", "cancelling"),
    ("finalizing_at", "finalizing (its job ended; files being written)"),
    ("completed_at", "completed"),
    ("failed_at", "failed"),
    ("expired_at", "expired (its completion window passed)"),
    ("cancelled_at", "cancelled"),
)


def _size(count: int) -> str:
    from embeddings.services.jobs.budget import size_text

    return size_text(count)


def _utc(moment: datetime | None) -> str:
    return "-" if moment is None else f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def _relative(moment: datetime, now: datetime) -> str:
    """ "in 23 hours", "4 weeks ago": short enough for a list's cell (its title holds the moment)."""
    if moment > now:
        return f"in {timeuntil(moment, now, depth=1)}"
    return f"{timesince(moment, now, depth=1)} ago"


def _counts(batch: Batch) -> BatchCounts:
    from embeddings.services.openai_api.batches import batch_counts

    return batch_counts(batch)


def _file_url(file_pk: int) -> str:
    return reverse("admin:embeddings_storedfile_change", args=[file_pk])


def _download_url(file_pk: int) -> str:
    return reverse("admin:embeddings_storedfile_download", args=[file_pk])


def _file_expiry(stored: StoredFile, now: datetime) -> str:
    if stored.expires_at is None:
        return "never"
    text = _relative(stored.expires_at, now)
    expired = stored.expires_at <= now
    return format_html(
        '<span class="{}" title="{}">{}{}</span>',
        "file-expired" if expired else "file-expires",
        _utc(stored.expires_at),
        "expired " if expired else "",
        text,
    )


# --- Batches -------------------------------------------------------------------------------------


class BatchStatusFilter(StatusFilter):
    statuses = Status
    active = ACTIVE
    active_label = "active (validating, in progress, finalizing, cancelling)"


class BatchEndpointFilter(admin.SimpleListFilter):
    """The endpoints a batch may name (not a DISTINCT over every batch, as Django's would read)."""

    title = "endpoint"
    parameter_name = "endpoint"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        from embeddings.services.openai_api.batches import ENDPOINTS

        return [(endpoint, endpoint) for endpoint in ENDPOINTS]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Batch]) -> QuerySet[Batch]:
        return queryset.filter(endpoint=self.value()) if self.value() else queryset


class BatchModelFilter(admin.SimpleListFilter):
    """A batch's model (its first line's, by the catalog's name), from the catalog, not a DISTINCT."""

    title = "model"
    parameter_name = "model"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [
            (name, name) for name in EmbeddingModel.objects.order_by("name").values_list("name", flat=True)
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Batch]) -> QuerySet[Batch]:
        return queryset.filter(model=self.value()) if self.value() else queryset


@admin.register(Batch)
class BatchAdmin(OperatorPagesAdmin):
    list_display = (
        "public_id",
        "tenant",
        "model",
        "status",
        "progress",
        "invalid_lines",
        "tokens",
        "age",
        "expiry",
        "job_link",
        "files",
    )
    list_filter = ("tenant", BatchStatusFilter, BatchEndpointFilter, BatchModelFilter)
    date_hierarchy = "created_at"
    ordering = ("-created_at", "-id")
    list_select_related = ("tenant", "job", "input_file", "output_file", "error_file")
    search_fields = ("public_id",)
    search_help_text = (
        "A batch's id (batch_...), its job's (job_...) or one of its files' (file-...), exactly."
    )
    # One COUNT for the filtered list, not a second one for the whole table.
    show_full_result_count = False
    list_per_page = 50
    actions = ("cancel_batches",)
    change_list_template = "admin/embeddings/batch/change_list.html"
    change_form_template = "admin/embeddings/batch/change_form.html"
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "public_id",
                    "tenant",
                    "api_key",
                    "status",
                    "endpoint",
                    "completion_window",
                    "model",
                    "metadata_text",
                )
            },
        ),
        ("Requests", {"fields": ("progress", "invalid_lines", "tokens")}),
        ("Job", {"fields": ("job_detail", "handed_out")}),
    )

    # --- Read-only (OperatorPagesAdmin): batches are the API's and the engine's -----------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[Batch]:
        # A batch's page shows its key, job and files too: read with it, as the list reads them.
        return super().get_queryset(request).select_related(*self.list_select_related, "api_key")

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Batch], search_term: str):
        term = search_term.strip()
        if not term:
            return queryset, False
        if term.startswith("file-"):
            # By the file's key: an OR over the three foreign keys' indexes, not over three joins.
            file_pk = StoredFile.objects.filter(public_id=term).values_list("pk", flat=True).first()
            if file_pk is None:  # deleted: a batch still names its input file by id
                return queryset.filter(input_file_public_id=term), False
            named = Q(input_file_id=file_pk) | Q(output_file_id=file_pk) | Q(error_file_id=file_pk)
            return queryset.filter(named), False
        if term.startswith("job_"):
            return queryset.filter(job__public_id=term), False
        return queryset.filter(public_id=term), False

    # --- Columns --------------------------------------------------------------------------------------

    @admin.display(description="requests: done / total")
    def progress(self, batch: Batch) -> str:
        counts = _counts(batch)
        return format_html('{}<span class="job-rows">{}</span>', progress_bar(counts), rows_done(counts))

    @admin.display(description="tokens")
    def tokens(self, batch: Batch) -> str:
        return f"{_counts(batch).tokens:,}"

    @admin.display(description="age", ordering="created_at")
    def age(self, batch: Batch) -> str:
        return timesince(batch.created_at, timezone.now(), depth=2)

    @admin.display(description="expiry")
    def expiry(self, batch: Batch) -> str:
        """While it runs, the end of its completion window; once final, its files' first expiry."""
        now = timezone.now()
        if batch.status in ACTIVE:
            if batch.expires_at is None:
                return "-"
            return format_html(
                '<span title="completion window ends {}">window: {}</span>',
                _utc(batch.expires_at),
                _relative(batch.expires_at, now),
            )
        expiries = [
            stored.expires_at
            for stored in (batch.output_file, batch.error_file)
            if stored is not None and stored.expires_at is not None
        ]
        if not expiries:
            return "-"
        first = min(expiries)
        return format_html(
            '<span title="files expire {}">files: {}</span>', _utc(first), _relative(first, now)
        )

    @admin.display(description="job")
    def job_link(self, batch: Batch) -> str:
        if batch.job is None:
            if batch.status in (Status.VALIDATING, Status.CANCELLING):
                return "none yet"
            return format_html(
                '<span title="{}">-</span>',
                "deleted once its files were written" if batch.in_progress_at else "none: it never ran",
            )
        # Its status as the link's text, its id in the title: the id would take the list's width.
        return format_html(
            '<a href="{}" title="{}">{}</a>',
            reverse("admin:embeddings_embeddingjob_change", args=[batch.job.pk]),
            batch.job.public_id,
            batch.job.status,
        )

    @admin.display(description="job")
    def job_detail(self, batch: Batch) -> str:
        if batch.job is None:
            return self.job_link(batch)
        return format_html(
            '<a href="{}">{}</a> ({}, {})',
            reverse("admin:embeddings_embeddingjob_change", args=[batch.job.pk]),
            batch.job.public_id,
            batch.job.status,
            rows_done(batch.job),
        )

    @admin.display(description="last handed to a worker (validation or finalisation)")
    def handed_out(self, batch: Batch) -> str:
        return _utc(batch.handed_out_at)

    @admin.display(description="files")
    def files(self, batch: Batch) -> str:
        links = []
        if batch.input_file is not None:
            links.append(self._file_link("input", batch.input_file))
        else:
            links.append(format_html('<span title="{}">input (deleted)</span>', batch.input_file_public_id))
        for role, stored in (("output", batch.output_file), ("error", batch.error_file)):
            if stored is not None:
                links.append(self._file_link(role, stored))
        return format_html_join(" · ", "{}", ((link,) for link in links))

    @staticmethod
    def _file_link(role: str, stored: StoredFile) -> str:
        return format_html(
            '<a class="batch-file-{}" href="{}" title="{}, {} bytes">{}</a>',
            role,
            _file_url(stored.pk),
            stored.public_id,
            f"{stored.bytes:,}",
            role,
        )

    @admin.display(description="metadata")
    def metadata_text(self, batch: Batch) -> str:
        if not batch.metadata:
            return "-"
        return format_html("<pre>{}</pre>", json.dumps(batch.metadata, indent=2, ensure_ascii=False))

    # --- The batch's page -----------------------------------------------------------------------------

    def page_context(self, request: HttpRequest, batch: Batch) -> dict:
        from embeddings.services.openai_api.operator import batch_cancel_refusal

        now = timezone.now()
        timeline = sorted(
            ((getattr(batch, field), label) for field, label in TIMELINE if getattr(batch, field)),
            key=lambda row: row[0],
        )
        return {
            "batch": batch,
            "can_act": self.has_change_permission(request, batch),
            "cancel_url": reverse("admin:embeddings_batch_act", args=[batch.pk, "cancel"]),
            "cancel_refusal": batch_cancel_refusal(batch),
            "timeline_rows": [(label, _utc(moment)) for moment, label in timeline],
            "window_end": _utc(batch.expires_at),
            "file_rows": self._file_rows(request, batch, now),
            "error_rows": batch.errors[:ERRORS_SHOWN],
            "errors_kept": len(batch.errors),
        }

    def _file_rows(self, request: HttpRequest, batch: Batch, now: datetime) -> list[dict]:
        from embeddings.services.openai_api.operator import file_download_refusal

        may_download = request.user.has_perm("embeddings.view_storedfile") or request.user.has_perm(
            "embeddings.change_storedfile"
        )
        rows = []
        for role, stored in (
            ("input", batch.input_file),
            ("output", batch.output_file),
            ("error", batch.error_file),
        ):
            if stored is None:
                if role == "input":
                    rows.append({"role": role, "gone": batch.input_file_public_id})
                continue
            refusal = file_download_refusal(stored, now=now)
            rows.append(
                {
                    "role": role,
                    "file": stored,
                    "url": _file_url(stored.pk),
                    "size": f"{_size(stored.bytes)} ({stored.bytes:,} bytes)",
                    "expiry": _file_expiry(stored, now),
                    "download_url": _download_url(stored.pk) if may_download and refusal is None else None,
                    "download_refusal": refusal,
                }
            )
        return rows

    def act_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        """A batch page's action button: POST only, by staff who may change batches (403 otherwise)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        batch = self.get_object(request, object_id)
        if batch is None:
            return HttpResponseRedirect(reverse("admin:embeddings_batch_changelist"))
        if not self.has_change_permission(request, batch):
            raise PermissionDenied
        if action != "cancel":
            return HttpResponseNotAllowed(["POST"])
        outcome = self._cancel(request, batch)
        self.message_user(request, outcome.text, messages.SUCCESS if outcome.done else messages.WARNING)
        return HttpResponseRedirect(reverse("admin:embeddings_batch_change", args=[batch.pk]))

    def _cancel(self, request: HttpRequest, batch: Batch) -> ActionOutcome:
        """Cancel one batch; what was done (logged to the admin's history) or why not."""
        import redis
        from kombu.exceptions import OperationalError

        from embeddings.errors.service import BatchActionRefused, ServiceError
        from embeddings.services.openai_api.operator import batch_cancel_by_operator

        try:
            cancelled = batch_cancel_by_operator(batch=batch, actor=request.user.get_username())
        except BatchActionRefused as refusal:
            return ActionOutcome(False, refusal.message)
        except (ServiceError, redis.RedisError, OperationalError) as error:
            return ActionOutcome(
                False,
                f"Batch {batch.public_id}: Redis, the job store or the broker did not answer ({error}); "
                "look at the batch before trying again.",
            )
        if cancelled.job_id is None:
            text = f"Batch {batch.public_id} is cancelling: it ends before its lines run."
        else:
            text = (
                f"Batch {batch.public_id} is cancelling: it stops once its running chunks have; what "
                "finished goes to its output file, the rest to its error file (batch_cancelled)."
            )
        self.log_change(request, batch, text)
        return ActionOutcome(True, text)

    # `permissions=["change"]`: offered only to staff who may change batches.
    @admin.action(description="Cancel selected batches", permissions=["change"])
    def cancel_batches(self, request: HttpRequest, queryset: QuerySet[Batch]) -> None:
        outcomes = [self._cancel(request, batch) for batch in queryset.order_by("pk")]
        self.message_outcomes(request, outcomes, done_text="{done} of {total} batches: cancelling.")


# --- Files ---------------------------------------------------------------------------------------


class FileExpiredFilter(admin.SimpleListFilter):
    title = "expiry"
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("no", "live (served by the API)"), ("yes", "expired (deleted at the next sweep)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[StoredFile]) -> QuerySet[StoredFile]:
        live = Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
        if self.value() == "no":
            return queryset.filter(live)
        if self.value() == "yes":
            return queryset.exclude(live)
        return queryset


class FileChangeList(ChangeList):
    """The files list, each file of the page given the batches naming it (`batch_uses`): one query."""

    def get_results(self, request: HttpRequest) -> None:
        from embeddings.services.openai_api.operator import files_uses

        super().get_results(request)
        uses = files_uses(self.result_list)
        for stored in self.result_list:
            stored.batch_uses = uses[stored.pk]


def _use_text(use: FileUse) -> str:
    return format_html(
        '<a href="{}">{}</a> ({}, {})',
        reverse("admin:embeddings_batch_change", args=[use.batch.pk]),
        use.batch.public_id,
        use.role,
        use.batch.status,
    )


@admin.register(StoredFile)
class StoredFileAdmin(admin.ModelAdmin):
    list_display = ("public_id", "tenant", "filename", "purpose", "size", "created_at", "expiry", "used_by")
    list_filter = ("tenant", "purpose", FileExpiredFilter)
    date_hierarchy = "created_at"
    ordering = ("-created_at", "-id")
    list_select_related = ("tenant",)
    search_fields = ("public_id", "filename")
    search_help_text = "A file's id (file-...), exactly, or part of its name."
    show_full_result_count = False
    list_per_page = 50
    change_form_template = "admin/embeddings/storedfile/change_form.html"
    delete_confirmation_template = "admin/embeddings/storedfile/delete_confirmation.html"
    delete_selected_confirmation_template = "admin/embeddings/storedfile/delete_selected_confirmation.html"
    fields = (
        "public_id",
        "tenant",
        "filename",
        "purpose",
        "size_exact",
        "created",
        "expires",
        "storage_name",
    )

    # --- Read-only: files are uploaded through the API, or written by a batch --------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: StoredFile | None = None) -> tuple[str, ...]:
        return self.fields

    def get_changelist(self, request: HttpRequest, **kwargs) -> type[ChangeList]:
        return FileChangeList

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[StoredFile], search_term: str):
        term = search_term.strip()
        if not term:
            return queryset, False
        if re.fullmatch(r"file-[A-Za-z0-9]+", term):
            return queryset.filter(public_id=term), False
        return queryset.filter(filename__icontains=term), False

    # --- Columns --------------------------------------------------------------------------------------

    @admin.display(description="size", ordering="bytes")
    def size(self, stored: StoredFile) -> str:
        return format_html('<span title="{} bytes">{}</span>', f"{stored.bytes:,}", _size(stored.bytes))

    @admin.display(description="size")
    def size_exact(self, stored: StoredFile) -> str:
        return f"{_size(stored.bytes)} ({stored.bytes:,} bytes)"

    @admin.display(description="expiry", ordering="expires_at")
    def expiry(self, stored: StoredFile) -> str:
        return _file_expiry(stored, timezone.now())

    @admin.display(description="created")
    def created(self, stored: StoredFile) -> str:
        return _utc(stored.created_at)

    @admin.display(description="expires")
    def expires(self, stored: StoredFile) -> str:
        if stored.expires_at is None:
            return "never"
        return format_html("{} ({})", _utc(stored.expires_at), _file_expiry(stored, timezone.now()))

    @admin.display(description="used by (batch, role, status)")
    def used_by(self, stored: StoredFile) -> str:
        uses = getattr(stored, "batch_uses", None)
        if not uses:
            return "-"
        listed = format_html_join(mark_safe("<br>"), "{}", ((_use_text(use),) for use in uses[:USES_LISTED]))
        if len(uses) > USES_LISTED:
            return format_html("{}<br>… and {} more", listed, len(uses) - USES_LISTED)
        return listed

    # --- The file's page, its download ----------------------------------------------------------------

    def get_urls(self):
        download = self.admin_site.admin_view(self.download_view)
        own = path("<path:object_id>/download/", download, name="embeddings_storedfile_download")
        return [own, *super().get_urls()]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None):
        if request.method == "POST":  # nothing here is saved
            return HttpResponseNotAllowed(["GET"])
        from embeddings.services.openai_api.operator import file_download_refusal, files_uses

        stored = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if stored is not None:
            context |= {
                "download_url": _download_url(stored.pk),
                "download_refusal": file_download_refusal(stored),
                "uses": files_uses([stored])[stored.pk],
            }
        context |= {"show_save": False, "show_save_and_continue": False, "show_save_and_add_another": False}
        return super().change_view(request, object_id, form_url, context)

    def download_view(self, request: HttpRequest, object_id: str) -> HttpResponse | StreamingHttpResponse:
        """The file's bytes, streamed from the files storage, for staff who may view files."""
        from embeddings.api.rendering import in_threads
        from embeddings.services.openai_api.files import file_pieces
        from embeddings.services.openai_api.operator import file_download_refusal

        stored = self.get_object(request, object_id)
        if stored is None:
            raise Http404("No such file.")
        if not self.has_view_permission(request, stored):
            raise PermissionDenied
        if refusal := file_download_refusal(stored):
            return HttpResponseNotFound(f"File {stored.public_id}: {refusal}.", content_type="text/plain")
        response = StreamingHttpResponse(
            in_threads(lambda: file_pieces(stored)), content_type="application/octet-stream"
        )
        response["Content-Length"] = str(stored.bytes)
        response["Content-Disposition"] = content_disposition_header(
            True, f"{stored.public_id}_{stored.filename}"
        )
        return response

    # --- Deleting: the API's file_delete, what it did to batches said and logged -----------------------

    def get_deleted_objects(self, objs, request: HttpRequest):
        """Django's confirmation lists what goes; under each file, the batches naming it (kept) and
        what its deletion does to each."""
        from embeddings.services.openai_api.operator import files_uses

        _, model_count, perms_needed, protected = super().get_deleted_objects(objs, request)
        files = list(objs)
        uses = files_uses(files)
        listed: list = []
        for stored in files:
            listed.append(
                format_html(
                    '<a href="{}">{}</a>: {}, its bytes ({}) deleted from the files storage',
                    _file_url(stored.pk),
                    stored.public_id,
                    stored.filename,
                    _size(stored.bytes),
                )
            )
            if uses[stored.pk]:
                listed.append([self._effect_html(use) for use in uses[stored.pk]])
        return listed, model_count, perms_needed, protected

    @staticmethod
    def _effect_html(use: FileUse) -> str:
        return format_html("{}: {}", _use_text(use), use.deletion_effect)

    def log_deletions(self, request: HttpRequest, queryset) -> None:
        """Logged by delete_model and delete_queryset once the file is gone, saying what it did."""

    def delete_model(self, request: HttpRequest, obj: StoredFile) -> None:
        self._say_effects(request, self._delete(request, obj))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[StoredFile]) -> None:
        effects = [
            effect for stored in list(queryset.order_by("pk")) for effect in self._delete(request, stored)
        ]
        self._say_effects(request, effects)

    def _delete(self, request: HttpRequest, stored: StoredFile) -> list[str]:
        """One file, through the API's file_delete; logged with what it did to each batch naming it
        (also in each of those batches' history). What it did to them, for the messages."""
        from embeddings.services.openai_api.operator import file_delete_by_operator

        uses = file_delete_by_operator(stored=stored)
        effects = [
            f"Batch {use.batch.public_id} ({use.role} file {stored.public_id}): {use.deletion_effect}."
            for use in uses
        ]
        summary = (
            f"File {stored.public_id} ({stored.filename}, {stored.bytes:,} bytes) and its bytes deleted."
        )
        LogEntry.objects.log_actions(
            user_id=request.user.pk,
            queryset=[stored],
            action_flag=DELETION,
            change_message=" ".join([summary, *effects]),
            single_object=True,
        )
        for use in uses:
            self.log_change(
                request,
                use.batch,
                f"Its {use.role} file {stored.public_id} was deleted: {use.deletion_effect}.",
            )
        return effects

    def _say_effects(self, request: HttpRequest, effects: list[str]) -> None:
        """Beside Django's own "deleted" message: what the deletion did to batches."""
        for effect in effects[:REFUSALS_LISTED]:
            self.message_user(request, effect, messages.WARNING)
        if len(effects) > REFUSALS_LISTED:
            self.message_user(
                request, f"… and {len(effects) - REFUSALS_LISTED} more batches.", messages.WARNING
            )

    def changelist_view(self, request: HttpRequest, extra_context=None):
        # Django ignores an action the user may not run ("No action selected"): refuse it instead.
        if request.method == "POST" and "action" in request.POST and not self.has_delete_permission(request):
            raise PermissionDenied
        return super().changelist_view(request, extra_context)
