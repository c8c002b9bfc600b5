"""The admin's jobs: a list an operator scans (filters by tenant, status, model, kind and date;
progress bars, age, tokens, storage held, callback state) and a job's page (its chunks, events and
sizes from the job store), with the actions of embeddings/services/jobs/operator.py: cancel, extend
the expiry, run failed chunks again, re-send the callback.

Thin, as the rest of the admin: every action is one service call; what it did goes to the admin's
history (LogEntry) and to a message. Jobs are made through the API only: no adding, editing or
deleting here. Staff who may only view (Django's view permission) see every page but no action,
and a POSTed action is refused with 403. The list reads no Redis and makes the same few queries
whatever the page holds (the storage held is a subquery, tenant and model are joined); the job
page reads the job store.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince

from embeddings.admin_operator import ActionOutcome, OperatorPagesAdmin, StatusFilter
from embeddings.models import JOB_ID_PATTERN, EmbeddingJob, JobStorageHold

# The jobs wing (Redis, numpy, Celery) is imported by the views that use it, not here: every
# process imports the admin at start-up, and most never render an admin page (admin.py says so).
if TYPE_CHECKING:
    from embeddings.services.jobs.operator import JobInspection

Status = EmbeddingJob.Status
# The changelist's "Extend expiry" action, and the job page's default.
EXTEND_DAYS = 7
MAX_EXTEND_DAYS = 365
# The job page's buttons, in order (each an action of _perform).
ACTION_LABELS = {
    "cancel": "Cancel the job",
    "extend": "Extend expiry",
    "retry": "Retry failed chunks",
    "resend_callback": "Re-send the callback",
}


def _bytes_text(count: int) -> str:
    from embeddings.services.jobs.budget import size_text

    return size_text(count)


def _utc(moment: datetime | None) -> str:
    return "-" if moment is None else f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def progress_bar(job: EmbeddingJob) -> str:
    """The job's rows done as a bar drawn by CSS (the templates' style): completed, then failed."""
    total = max(job.total, 1)
    completed, failed = 100 * job.completed / total, 100 * job.failed / total
    return format_html(
        '<div class="job-progress" role="progressbar" aria-valuemin="0" aria-valuemax="{}" '
        'aria-valuenow="{}" title="{} completed, {} failed of {}">'
        '<span class="job-progress-completed" style="width: {}%"></span>'
        '<span class="job-progress-failed" style="width: {}%"></span></div>',
        job.total,
        job.completed + job.failed,
        f"{job.completed:,}",
        f"{job.failed:,}",
        f"{job.total:,}",
        f"{completed:.2f}",
        f"{failed:.2f}",
    )


def rows_done(job: EmbeddingJob) -> str:
    """Inputs done (completed or failed) of the job's total, and how many failed."""
    done = f"{job.completed + job.failed:,} / {job.total:,}"
    return f"{done} ({job.failed:,} failed)" if job.failed else done


def callback_state(job: EmbeddingJob) -> str:
    """Where the job's callback stands, with its last error."""
    if not job.callback_url:
        return "-"
    attempts = f"{job.callback_attempts} attempt{'s' if job.callback_attempts != 1 else ''}"
    if job.callback_delivered_at is not None:
        return format_html(
            '<span class="callback-delivered">delivered {} ({})</span>',
            _utc(job.callback_delivered_at),
            attempts,
        )
    if job.callback_error:
        return format_html(
            '<span class="callback-failing errornote-inline">not delivered ({}): {}</span>',
            attempts,
            job.callback_error,
        )
    if job.status in EmbeddingJob.ACTIVE:
        return "sent when it finishes"
    return f"pending ({attempts})"


class JobStatusFilter(StatusFilter):
    statuses = Status
    active = EmbeddingJob.ACTIVE
    active_label = "active (queued, running, cancelling)"


class JobKindFilter(admin.SimpleListFilter):
    """The kinds settings.JOB_KINDS names (not a DISTINCT over every job, as Django's would read)."""

    title = "kind"
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(kind, kind) for kind in settings.JOB_KINDS]

    def queryset(self, request: HttpRequest, queryset: QuerySet[EmbeddingJob]) -> QuerySet[EmbeddingJob]:
        return queryset.filter(kind=self.value()) if self.value() else queryset


@admin.register(EmbeddingJob)
class EmbeddingJobAdmin(OperatorPagesAdmin):
    # Narrow enough for a laptop's screen beside the filters: the bar and its counts share a column,
    # the kind is a filter only.
    list_display = (
        "public_id",
        "tenant",
        "model",
        "status",
        "progress",
        "age",
        "tokens",
        "storage_held",
        "callback",
    )
    list_filter = (JobStatusFilter, "tenant", "model", JobKindFilter)
    date_hierarchy = "created_at"
    list_select_related = ("tenant", "model")
    # A job's id or its Idempotency-Key, exactly (get_search_results): Django's own search would
    # compare case-insensitively, which no index serves.
    search_fields = ("public_id", "idempotency_key")
    search_help_text = "A job's id (job_...) or its Idempotency-Key, exactly."
    # One COUNT for the filtered list, not a second one for the whole table.
    show_full_result_count = False
    list_per_page = 50
    actions = ("cancel_jobs", "extend_expiry", "retry_failed_chunks", "resend_callbacks")
    change_list_template = "admin/embeddings/embeddingjob/change_list.html"
    change_form_template = "admin/embeddings/embeddingjob/change_form.html"
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "public_id",
                    "tenant",
                    "api_key",
                    "model",
                    "kind",
                    "status",
                    "error_code",
                    "error_message",
                    "created_at",
                    "started_at",
                    "finished_at",
                    "expires_at",
                    "latest_expiry",
                )
            },
        ),
        (
            "Progress",
            {
                "fields": (
                    "progress",
                    "chunks",
                    "chunk_size",
                    "prompt_tokens",
                    "cached_tokens",
                    "reserved_tokens",
                )
            },
        ),
        ("Callback", {"fields": ("callback_url", "callback", "callback_attempts", "callback_delivered_at")}),
        (
            "How it was asked for",
            {
                "classes": ["collapse"],
                "fields": (
                    "encoding_format",
                    "dimensions",
                    "dims",
                    "normalize",
                    "result_dtype",
                    "output_type",
                    "input_type",
                    "has_ids",
                    "metadata",
                    "idempotency_key",
                    "request_fingerprint",
                ),
            },
        ),
    )

    # --- Read-only (OperatorPagesAdmin): jobs are the API's and the engine's ---------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[EmbeddingJob]:
        held = JobStorageHold.objects.filter(public_id=OuterRef("public_id")).values("stored_bytes")[:1]
        return super().get_queryset(request).annotate(held_bytes=Subquery(held))

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[EmbeddingJob], search_term: str):
        term = search_term.strip()
        if not term:
            return queryset, False
        field = "public_id" if re.fullmatch(JOB_ID_PATTERN, term) else "idempotency_key"
        return queryset.filter(**{field: term}), False

    # --- Columns --------------------------------------------------------------------------------------

    @admin.display(description="progress: done / total")
    def progress(self, job: EmbeddingJob) -> str:
        return format_html('{}<span class="job-rows">{}</span>', progress_bar(job), rows_done(job))

    @admin.display(description="age", ordering="created_at")
    def age(self, job: EmbeddingJob) -> str:
        return timesince(job.created_at, timezone.now(), depth=2)

    @admin.display(description="tokens", ordering="prompt_tokens")
    def tokens(self, job: EmbeddingJob) -> str:
        cached = f" ({job.cached_tokens:,} cached)" if job.cached_tokens else ""
        return f"{job.prompt_tokens:,}{cached}"

    @admin.display(description="storage held", ordering="held_bytes")
    def storage_held(self, job: EmbeddingJob) -> str:
        held = getattr(job, "held_bytes", None)
        if held is None:
            return "-"
        return format_html('<span title="{} bytes">{}</span>', f"{held:,}", _bytes_text(held))

    @admin.display(description="callback")
    def callback(self, job: EmbeddingJob) -> str:
        return callback_state(job)

    @admin.display(description="latest expiry allowed")
    def latest_expiry(self, job: EmbeddingJob) -> str:
        from embeddings.services.jobs.operator import job_expiry_bound

        return f"{_utc(job_expiry_bound(job))} (JOB_MAX_RETENTION_S after submission)"

    # --- The job's page ---------------------------------------------------------------------------------

    def page_context(self, request: HttpRequest, job: EmbeddingJob) -> dict:
        from embeddings.services.jobs.operator import job_inspect

        inspection = job_inspect(job=job)
        return {
            "inspection": inspection,
            "can_act": self.has_change_permission(request, job),
            "action_buttons": self._action_buttons(job, inspection),
            "chunk_rows": [
                {
                    "chunk": state.chunk,
                    "rows": min(job.chunk_size, job.total - state.chunk * job.chunk_size),
                    "state": state.state,
                    "attempts": state.attempts,
                    "lease_owner": state.lease_owner or "-",
                    "lease": self._lease_text(state.lease_deadline_ms, inspection.clock_ms),
                    "started": self._ms_text(state.started_ms),
                    "error": state.error,
                }
                for state in inspection.chunks
            ],
            "event_rows": [
                {"at": self._ms_text(event.at_ms), "event": event.event, "detail": event.detail}
                for event in reversed(inspection.events)
            ],
            "download_size": None
            if inspection.download_bytes is None
            else f"{_bytes_text(inspection.download_bytes)} ({inspection.download_bytes:,} bytes)",
            "hold_rows": None if inspection.hold is None else self._hold_rows(inspection),
            "extend_days": EXTEND_DAYS,
            "max_extend_days": MAX_EXTEND_DAYS,
        }

    def _action_buttons(self, job: EmbeddingJob, inspection: JobInspection) -> list[dict]:
        return [
            {
                "action": action,
                "label": label,
                "url": reverse("admin:embeddings_embeddingjob_act", args=[job.pk, action]),
                "refusal": inspection.actions[action],
            }
            for action, label in ACTION_LABELS.items()
        ]

    @staticmethod
    def _ms_text(moment_ms: int | None) -> str:
        if moment_ms is None:
            return "-"
        return _utc(datetime.fromtimestamp(moment_ms / 1000, tz=UTC))

    @staticmethod
    def _lease_text(deadline_ms: int | None, clock_ms: int) -> str:
        if deadline_ms is None:
            return "-"
        seconds = (deadline_ms - clock_ms) / 1000
        return f"until {seconds:.0f} s from now" if seconds >= 0 else f"lapsed {-seconds:.0f} s ago"

    @staticmethod
    def _hold_rows(inspection: JobInspection) -> list[tuple[str, str]]:
        hold = inspection.hold
        return [
            (name, f"{_bytes_text(value)} ({value:,} bytes)")
            for name, value in (
                ("held now", hold.stored_bytes),
                ("of which results (if every input succeeds)", hold.result_bytes),
                ("inputs at submission (freed at the end)", hold.input_bytes),
                ("ids and bookkeeping (kept until expiry)", hold.kept_bytes),
            )
        ]

    def act_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        """A job page's action button: POST only, by staff who may change jobs (403 otherwise)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        job = self.get_object(request, object_id)
        if job is None:
            return HttpResponseRedirect(reverse("admin:embeddings_embeddingjob_changelist"))
        if not self.has_change_permission(request, job):
            raise PermissionDenied
        if action not in ACTION_LABELS:
            return HttpResponseNotAllowed(["POST"])
        days = EXTEND_DAYS
        if action == "extend":
            try:
                days = int(request.POST.get("days", EXTEND_DAYS))
            except ValueError:
                days = 0
            if not 1 <= days <= MAX_EXTEND_DAYS:
                self.message_user(request, f"Extend by 1 to {MAX_EXTEND_DAYS} days.", messages.ERROR)
                return HttpResponseRedirect(reverse("admin:embeddings_embeddingjob_change", args=[job.pk]))
        outcome = self._perform(request, job, action, days=days)
        self.message_user(request, outcome.text, messages.SUCCESS if outcome.done else messages.WARNING)
        return HttpResponseRedirect(reverse("admin:embeddings_embeddingjob_change", args=[job.pk]))

    # --- The actions: each one service call per job ----------------------------------------------------

    def _perform(
        self, request: HttpRequest, job: EmbeddingJob, action: str, *, days: int = EXTEND_DAYS
    ) -> ActionOutcome:
        """Run one action on one job; what it did (logged to the admin's history) or why not."""
        import redis
        from kombu.exceptions import OperationalError

        from embeddings.errors.service import JobActionRefused, ServiceError
        from embeddings.services.jobs import operator

        actor = request.user.get_username()
        try:
            if action == "cancel":
                operator.job_cancel_by_operator(job=job, actor=actor)
                text = f"Job {job.public_id} is cancelling: it stops once its running chunks have."
            elif action == "extend":
                extension = operator.job_extend_expiry(job=job, by=timedelta(days=days), actor=actor)
                text = f"Job {job.public_id} now expires at {_utc(extension.expires_at)}" + (
                    " (the latest allowed: JOB_MAX_RETENTION_S after its submission)."
                    if extension.capped
                    else "."
                )
            elif action == "retry":
                started = operator.job_retry_failed_chunks(job=job, actor=actor)
                text = (
                    f"Job {job.public_id} is running again: {len(started.chunks)} failed chunk(s), "
                    f"{started.inputs:,} inputs; {started.reserved_tokens:,} tokens reserved."
                )
            else:
                job = operator.job_callback_resend(job=job, actor=actor)
                text = f"Job {job.public_id}'s callback is sent again to {job.callback_url}."
        except JobActionRefused as refusal:
            return ActionOutcome(False, refusal.message)
        except (ServiceError, redis.RedisError, OperationalError) as error:
            # A store or the broker failed part way (each service undoes what it can): say so, and
            # that the job's page shows where it stands.
            return ActionOutcome(
                False,
                f"Job {job.public_id}: Redis, the job store or the broker did not answer ({error}); "
                "look at the job before trying again.",
            )
        self.log_change(request, job, text)
        return ActionOutcome(True, text)

    def _perform_each(self, request: HttpRequest, queryset: QuerySet[EmbeddingJob], action: str) -> None:
        outcomes = [self._perform(request, job, action) for job in queryset.order_by("pk")]
        self.message_outcomes(request, outcomes, done_text="{done} of {total} jobs: done.")

    # `permissions=["change"]`: offered only to staff who may change jobs.
    @admin.action(description="Cancel selected jobs", permissions=["change"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[EmbeddingJob]) -> None:
        self._perform_each(request, queryset, "cancel")

    @admin.action(
        description=f"Extend expiry by {EXTEND_DAYS} days (at most JOB_MAX_RETENTION_S)",
        permissions=["change"],
    )
    def extend_expiry(self, request: HttpRequest, queryset: QuerySet[EmbeddingJob]) -> None:
        self._perform_each(request, queryset, "extend")

    @admin.action(description="Retry failed chunks of selected failed jobs", permissions=["change"])
    def retry_failed_chunks(self, request: HttpRequest, queryset: QuerySet[EmbeddingJob]) -> None:
        self._perform_each(request, queryset, "retry")

    @admin.action(description="Re-send callbacks of selected finished jobs", permissions=["change"])
    def resend_callbacks(self, request: HttpRequest, queryset: QuerySet[EmbeddingJob]) -> None:
        self._perform_each(request, queryset, "resend_callback")
