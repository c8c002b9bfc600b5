"""Django admin: tenants, API keys (secrets shown once), usage rows, and catalog models loaded into Triton.

Tenants show their keys, quotas, usage and webhook secrets; catalog models their state in Triton.

Thin: creating, revoking, deactivating and rotating go through the services the API and commands use; usage
numbers come from embeddings/services/quotas/reports.py, charts from embeddings/admin_charts.py.
"""

from __future__ import annotations

import csv
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html

from embeddings.admin_charts import daily_bar_chart
from embeddings.models import ApiKey, EmbeddingModel, QuotaLimits, Tenant, UsageBucket
from embeddings.services.accounts.api_keys import api_key_create, api_key_revoke
from embeddings.services.accounts.encryption import SecretUndecryptable
from embeddings.services.accounts.tenants import (
    tenant_deactivate,
    tenant_webhook_secret_rotate,
    tenant_webhook_signing_secrets,
    webhook_secret_fingerprint,
)
from embeddings.services.inference.catalog import embedding_model_cache_clear
from embeddings.services.inference.exports import DTYPE_FLOAT32, model_export_dtypes
from embeddings.services.quotas.reports import (
    CHART_DAYS,
    api_keys_with_month_usage,
    daily_usage,
    tenant_usage_summary,
    top_keys,
    usage_csv_rows,
)
from embeddings.triton import TritonError

# The job store (redis.asyncio), model serving and the Triton client (grpc, numpy) are imported by
# the admin views that use them, not here: every process imports this module at start-up
# (admin.autodiscover), and most of them never render an admin page.
if TYPE_CHECKING:
    from embeddings.services.inference.serving import ModelServingState
    from embeddings.triton import TritonClient

logger = logging.getLogger(__name__)

# The admin's ordinary rotation keeps the old webhook secret signing this long (as the command does).
WEBHOOK_OVERLAP_HOURS = 24
API_KEY_READONLY_FIELDS = ("public_id", "secret_hash", "created_at", "revoked_at", "last_used_at")
TENANT_QUOTAS_HELP = (
    "Blank: unlimited. A tenant's limits count the requests and tokens of all its keys together. "
    "Rates are smooth: a sustained rate, and a burst that may arrive at once (blank: a second of a "
    "request rate, a minute of a token rate); the day and month budgets are UTC calendar windows."
)
KEY_QUOTAS_HELP = (
    "Optional overrides for this key alone, on top of its tenant's limits. Blank: the tenant's limits only."
)


def with_quota_help(formfield, db_field, blank_means: str):
    if formfield is not None and db_field.name in QuotaLimits.QUOTA_FIELDS:
        model_help = str(db_field.help_text).rstrip(".")
        formfield.help_text = (
            f"{model_help}. Blank: {blank_means}." if model_help else f"Blank: {blank_means}."
        )
    return formfield


def live_quota_state(tenant: Tenant) -> tuple[list[dict], str | None]:
    """The tenant's rates and budgets as Redis holds them now: rows for the page, or why there are none.

    The page's numbers come from the database; this is extra, and the page renders without it.
    """
    try:
        from embeddings.services.quotas.limits import quota_status_sync

        status = quota_status_sync(tenant.pk)
    except Exception as error:  # Redis down or slow, or the quota module absent: say so, render the rest
        logger.warning("admin: live quota state of tenant %s unavailable: %r", tenant.pk, error)
        return [], f"Live quota state unavailable ({type(error).__name__})."
    rows = []
    for name, window in (status.get("tenant") or {}).items():
        if isinstance(window, dict) and window.get("limit") is not None and "used" in window:
            rows.append(
                {
                    "limit_name": name,
                    "name": name.replace("_", " "),
                    "used": f"{window['used']:,}",
                    # A rate's "used" is what its bucket lacks of its burst: "of" is the burst.
                    "limit": f"{window['limit']:,}"
                    if window.get("burst") is None
                    else f"{window['burst']:,} (burst; rate {window['limit']:,})",
                    "resets_at": window.get("resets_at") or "-",
                }
            )
    return rows, None


def api_key_status(api_key: ApiKey) -> str:
    if api_key.is_revoked():
        return "revoked"
    if api_key.is_expired(timezone.now()):
        return "expired"
    return "active"


class ApiKeyStatusFilter(admin.SimpleListFilter):
    """Active, revoked or expired, as `api_key_status` says (revoked wins over expired)."""

    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("active", "active"), ("revoked", "revoked"), ("expired", "expired")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> QuerySet[ApiKey]:
        now = timezone.now()
        not_revoked = queryset.filter(revoked_at__isnull=True)
        if self.value() == "active":
            return not_revoked.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return not_revoked.filter(expires_at__lte=now)
        return queryset


class ApiKeyInline(admin.TabularInline):
    """A tenant's keys, read-only: keys are made on the API key page, which shows the secret once."""

    model = ApiKey
    extra = 0
    can_delete = False
    show_change_link = True
    fields = ("name", "key_prefix", "status", "created_at", "expires_at", "revoked_at", "last_used_at")
    readonly_fields = fields

    @admin.display(description="key starts with")
    def key_prefix(self, api_key: ApiKey) -> str:
        return f"{api_key.prefix}…"

    @admin.display(description="status")
    def status(self, api_key: ApiKey) -> str:
        return api_key_status(api_key)

    def has_add_permission(self, request: HttpRequest, obj: Tenant | None = None) -> bool:
        return False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "is_active", "allow_all_models", "key_count", "created_at")
    list_filter = ("is_active", "allow_all_models")
    search_fields = ("name", "slug")
    prepopulated_fields = {"slug": ("name",)}
    filter_horizontal = ("allowed_models",)
    readonly_fields = ("created_at", "add_key_link", "webhook_secret_status", "job_storage_held")
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "name",
                    "slug",
                    "is_active",
                    "allow_all_models",
                    "allowed_models",
                    "created_at",
                    "add_key_link",
                    "webhook_secret_status",
                )
            },
        ),
        ("Quotas", {"fields": QuotaLimits.QUOTA_FIELDS, "description": TENANT_QUOTAS_HELP}),
        (
            "Job storage",
            {
                "fields": ("job_storage_budget_bytes", "job_storage_held"),
                "description": "What this tenant's jobs hold in the job store (inputs until a job ends, "
                "results until they expire). A job that would not fit the budget is refused at submission.",
            },
        ),
        (
            "Embedding cache",
            {
                "fields": ("shared_embedding_cache",),
                "description": "Where EMBEDDING_CACHE is on, a tenant's cached vectors are its own. "
                "Opting in shares them with every other tenant that did (more hits), at the price that "
                "a fast answer reveals a text someone else embedded. A model can opt in for all its "
                "tenants (its own setting).",
            },
        ),
    )
    inlines = (ApiKeyInline,)
    actions = ("deactivate_tenants", "rotate_webhook_secrets", "rotate_webhook_secrets_now")
    change_form_template = "admin/embeddings/tenant/change_form.html"
    webhook_secret_rotated_template = "admin/embeddings/tenant/webhook_secret_rotated.html"

    def formfield_for_dbfield(self, db_field, request: HttpRequest, **kwargs):
        return with_quota_help(
            super().formfield_for_dbfield(db_field, request, **kwargs), db_field, "unlimited"
        )

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None):
        tenant = self.get_object(request, object_id)
        if tenant is not None:
            extra_context = {**(extra_context or {}), "usage": self.usage_context(tenant)}
        return super().change_view(request, object_id, form_url, extra_context)

    def usage_context(self, tenant: Tenant) -> dict:
        now = timezone.now()
        days = daily_usage(tenant=tenant, now=now)
        first, last = days[0].day, days[-1].day
        span = f"{first:%Y-%m-%d} to {last:%Y-%m-%d} (UTC)"
        live_rows, live_error = live_quota_state(tenant)
        summary = tenant_usage_summary(tenant=tenant, now=now)
        windows = [
            ("This month", summary.month_tokens, summary.month_requests, "tokens_per_month"),
            ("Today", summary.day_tokens, summary.day_requests, "tokens_per_day"),
        ]
        return {
            "summary": summary,
            "month_counts": {
                name: f"{getattr(summary, f'month_{name}'):,}"
                for name in ("succeeded", "rejected", "failed", "inputs", "cached_inputs", "cached_tokens")
            },
            "windows": [
                {
                    "label": label,
                    "limit_name": limit_name,
                    "used": f"{budget.used:,}",
                    "limit": "unlimited" if budget.limit is None else f"{budget.limit:,}",
                    "percent": None if budget.percent is None else f"{budget.percent:.1f}",
                    "meter_value": None if budget.percent is None else f"{min(budget.percent, 100):.1f}",
                    "requests": f"{requests:,}",
                }
                for label, budget, requests, limit_name in windows
            ],
            "top_keys": [
                {"key": key, "tokens": f"{key.tokens:,}", "requests": f"{key.requests:,}"}
                for key in top_keys(tenant=tenant, now=now)
            ],
            "days": CHART_DAYS,
            "tokens_chart": daily_bar_chart(
                title=f"Tokens per day, last {CHART_DAYS} days",
                description=f"{tenant.name}: tokens used each UTC day, {span}; "
                f"{sum(day.tokens for day in days):,} in all.",
                days=[(day.day, day.tokens) for day in days],
                unit="tokens",
                chart_id="usage-tokens-chart",
            ),
            "requests_chart": daily_bar_chart(
                title=f"Requests per day, last {CHART_DAYS} days",
                description=f"{tenant.name}: requests each UTC day, {span}; "
                f"{sum(day.requests for day in days):,} in all.",
                days=[(day.day, day.requests) for day in days],
                unit="requests",
                chart_id="usage-requests-chart",
            ),
            "live_rows": live_rows,
            "live_error": live_error,
        }

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tenant]:
        return super().get_queryset(request).annotate(key_count=Count("api_keys"))

    @admin.display(description="keys", ordering="key_count")
    def key_count(self, tenant: Tenant) -> int:
        return tenant.key_count

    @admin.display(description="new key")
    def add_key_link(self, tenant: Tenant) -> str:
        if tenant.pk is None:
            return "Save the tenant first."
        url = reverse("admin:embeddings_apikey_add") + f"?tenant={tenant.pk}"
        return format_html('<a href="{}">Create an API key for this tenant</a>', url)

    @admin.display(description="stored now")
    def job_storage_held(self, tenant: Tenant) -> str:
        if tenant.pk is None:
            return "-"
        from embeddings.services.jobs.budget import size_text, tenant_job_storage

        storage = tenant_job_storage(tenant=tenant)
        percent = 100 * storage.used_bytes / storage.budget_bytes if storage.budget_bytes else 100.0
        return (
            f"{size_text(storage.used_bytes)} ({storage.used_bytes:,} bytes) of "
            f"{size_text(storage.budget_bytes)}: {percent:.1f}% of the budget"
        )

    @admin.display(description="webhook secret")
    def webhook_secret_status(self, tenant: Tenant) -> str:
        """Which secret signs (by fingerprint, never the secret) and until when the previous one does."""
        if not tenant.webhook_secret_encrypted:
            return "None yet (made at the first callback). Rotate it from the tenant list to see one."
        now = timezone.now()
        try:
            fingerprints = [
                webhook_secret_fingerprint(s) for s in tenant_webhook_signing_secrets(tenant=tenant, now=now)
            ]
        except SecretUndecryptable:
            return "Cannot be decrypted (SECRET_KEY changed without SECRET_KEY_FALLBACKS): rotate it."
        status = f"fingerprint {fingerprints[0]}, since {tenant.webhook_secret_created_at:%Y-%m-%d %H:%M} UTC"
        if len(fingerprints) > 1:
            until = tenant.webhook_previous_secret_expires_at
            status += f"; the previous one ({fingerprints[1]}) also signs until {until:%Y-%m-%d %H:%M} UTC"
        return status

    def _rotate_webhook_secrets(
        self, request: HttpRequest, queryset: QuerySet[Tenant], overlap: timedelta, note: str
    ) -> TemplateResponse:
        rotated = []
        for tenant in queryset.order_by("name"):
            secret = tenant_webhook_secret_rotate(tenant=tenant, overlap=overlap)
            rotated.append(
                {
                    "tenant": tenant,
                    "secret": secret,
                    "fingerprint": webhook_secret_fingerprint(secret),
                    "url": reverse("admin:embeddings_tenant_change", args=[tenant.pk]),
                }
            )
            self.log_change(request, tenant, f"Rotated the webhook secret ({note})")
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "New webhook secrets",
            "rotated": rotated,
            "overlap_note": note,
        }
        # Rendered into this one response and never cached: reloading never shows the secrets again.
        response = TemplateResponse(request, self.webhook_secret_rotated_template, context)
        add_never_cache_headers(response)
        return response

    @admin.action(
        description=f"Rotate webhook secrets (the old ones sign {WEBHOOK_OVERLAP_HOURS} h more)",
        permissions=["change"],
    )
    def rotate_webhook_secrets(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> TemplateResponse:
        overlap = timedelta(hours=WEBHOOK_OVERLAP_HOURS)
        note = f"The previous secrets also sign for {WEBHOOK_OVERLAP_HOURS} hours, so receivers can switch."
        return self._rotate_webhook_secrets(request, queryset, overlap, note)

    @admin.action(
        description="Rotate webhook secrets now (the old ones stop at once)", permissions=["change"]
    )
    def rotate_webhook_secrets_now(
        self, request: HttpRequest, queryset: QuerySet[Tenant]
    ) -> TemplateResponse:
        note = "The previous secrets no longer sign (as after a leak)."
        return self._rotate_webhook_secrets(request, queryset, timedelta(0), note)

    # Without `permissions`, Django offers an action to staff who may only view the changelist.
    @admin.action(description="Deactivate selected tenants", permissions=["change"])
    def deactivate_tenants(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        count = 0
        for tenant in queryset.filter(is_active=True):
            tenant_deactivate(tenant=tenant)
            count += 1
        self.message_user(request, f"Deactivated {count} tenant(s).", messages.SUCCESS)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "tenant",
        "key_prefix",
        "status",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "tokens_this_month",
        "requests_this_month",
    )
    list_filter = (ApiKeyStatusFilter, "tenant")
    list_select_related = ("tenant",)
    search_fields = ("name", "public_id", "tenant__name", "tenant__slug")
    autocomplete_fields = ("tenant",)
    actions = ("revoke_keys",)
    created_template = "admin/embeddings/apikey/created.html"

    # Adding asks for what the service needs; the service makes the id and the secret.
    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> tuple[str, ...]:
        if obj is None:
            return ("tenant", "name", "expires_at")
        return ("tenant", "name", "expires_at", *API_KEY_READONLY_FIELDS)

    def get_fieldsets(self, request: HttpRequest, obj: ApiKey | None = None):
        if obj is None:
            return super().get_fieldsets(request, obj)
        return (
            (None, {"fields": ("tenant", "name", "expires_at", *API_KEY_READONLY_FIELDS)}),
            ("Quota overrides", {"fields": QuotaLimits.QUOTA_FIELDS, "description": KEY_QUOTAS_HELP}),
        )

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> tuple[str, ...]:
        if obj is None:
            return ()
        return ("tenant", *API_KEY_READONLY_FIELDS)

    def formfield_for_dbfield(self, db_field, request: HttpRequest, **kwargs):
        formfield = super().formfield_for_dbfield(db_field, request, **kwargs)
        return with_quota_help(formfield, db_field, "the tenant's limits only")

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiKey]:
        return api_keys_with_month_usage(super().get_queryset(request), now=timezone.now())

    @admin.display(description="tokens this month", ordering="tokens_this_month")
    def tokens_this_month(self, api_key: ApiKey) -> str:
        return f"{api_key.tokens_this_month:,}"

    @admin.display(description="requests this month", ordering="requests_this_month")
    def requests_this_month(self, api_key: ApiKey) -> str:
        return f"{api_key.requests_this_month:,}"

    @admin.display(description="key starts with")
    def key_prefix(self, api_key: ApiKey) -> str:
        return f"{api_key.prefix}…"

    @admin.display(description="status")
    def status(self, api_key: ApiKey) -> str:
        return api_key_status(api_key)

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created, full_key = api_key_create(tenant=obj.tenant, name=obj.name, expires_at=obj.expires_at)
        # The admin goes on with `obj` (history entry, redirect): make it the row the service wrote.
        for field in created._meta.concrete_fields:
            setattr(obj, field.attname, getattr(created, field.attname))
        obj._state.adding = False
        obj._state.db = created._state.db
        # Held on this request only, for response_add; never in a message, session or cookie.
        request._embedsite_new_api_key = full_key

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue=None) -> HttpResponse:
        full_key = getattr(request, "_embedsite_new_api_key", None)
        if full_key is None:
            return super().response_add(request, obj, post_url_continue)
        # The key is rendered into this one response (no redirect that would need to carry it) and
        # the page must not be cached: reloading or going back never shows it again.
        opts = self.opts
        context = {
            **self.admin_site.each_context(request),
            "opts": opts,
            "title": "API key created",
            "api_key": obj,
            "full_key": full_key,
            "change_url": reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk]),
            "add_url": reverse(f"admin:{opts.app_label}_{opts.model_name}_add") + f"?tenant={obj.tenant_id}",
            "tenant_url": reverse("admin:embeddings_tenant_change", args=[obj.tenant_id]),
        }
        response = TemplateResponse(request, self.created_template, context)
        add_never_cache_headers(response)
        return response

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        now = timezone.now()
        count = 0
        for api_key in queryset.filter(revoked_at__isnull=True):
            api_key_revoke(api_key=api_key, now=now)
            count += 1
        self.message_user(request, f"Revoked {count} key(s).", messages.SUCCESS)


def triton_admin_client() -> TritonClient:
    """A client for admin pages: one try under READY_CHECK_TIMEOUT_S, so a Triton that is down or
    hung costs a page that long at most."""
    from embeddings.triton import TritonClient

    return TritonClient(settings.TRITON_GRPC_TARGET, timeout_s=settings.READY_CHECK_TIMEOUT_S, retries=0)


class EmbeddingModelForm(forms.ModelForm):
    """The pinned version is chosen among the model's finished exports on disk."""

    class Meta:
        model = EmbeddingModel
        fields = "__all__"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        triton_model = self.data.get("triton_model") or self.instance.triton_model
        dtypes = exported_versions(triton_model)
        versions = [str(v) for v in dtypes]
        # An int8 export is a version like any other: the label says which one it is.
        choices = [("", "Triton's latest")] + [
            (str(v), f"version {v}" if dtype == DTYPE_FLOAT32 else f"version {v} ({dtype})")
            for v, dtype in reversed(dtypes.items())
        ]
        current = self.instance.triton_version
        if current and current not in versions:
            choices.append((current, f"version {current} (no finished export on disk)"))
        self.fields["triton_version"] = forms.ChoiceField(
            choices=choices,
            required=False,
            label="Triton version",
            help_text="The exported version that serves; clients' vectors change only when this does. "
            "Changing it loads the new version next to the old, which is unloaded within "
            "MODEL_RECONCILE_INTERVAL_S.",
        )


def exported_versions(triton_model: str) -> dict[int, str]:
    """The model's finished exports, oldest first -> each one's dtype."""
    if not triton_model:
        return {}
    return model_export_dtypes(repository_dir=Path(settings.TRITON_MODEL_REPOSITORY), name=triton_model)


@admin.register(EmbeddingModel)
class EmbeddingModelAdmin(admin.ModelAdmin):
    """Catalog models. Loading and unloading go through services/inference/serving.py, as beat's
    reconcile and `register_model` do; Triton's failures are shown as messages, never a 500."""

    form = EmbeddingModelForm
    # Whether it serves comes first: the changelist scrolls sideways on narrow screens.
    list_display = (
        "name",
        "enabled",
        "task",
        "rerank_by_similarity",
        "triton_model",
        "triton_version",
        "dimensions",
        "max_tokens",
        "aliases",
        "result_dtype",
    )
    list_filter = ("enabled", "task", "rerank_by_similarity", "triton_model", "result_dtype")
    search_fields = ("name", "triton_model")
    # The task and a cross-encoder's activation are the export's (register_model reads export.json).
    readonly_fields = ("task", "score_activation", "created_at")
    actions = ("load_into_triton", "unload_from_triton")

    def get_list_display(self, request: HttpRequest):
        states = self._serving_states()

        @admin.display(description="Triton state")
        def triton_state(model: EmbeddingModel) -> str:
            state = states.get(model.pk) if states is not None else None
            if state is None:
                return "—"
            if state.ready or not state.reason:
                return state.state or "not loaded"
            return format_html('{} <span title="{}">ⓘ</span>', state.state or "not loaded", state.reason)

        name, enabled, *rest = self.list_display
        return (name, enabled, triton_state, *rest)

    def _serving_states(self) -> dict[int, ModelServingState] | None:
        """Each row's state from one repository index; None when Triton does not answer."""
        from embeddings.services.inference.serving import models_serving_states_sync

        rows = list(EmbeddingModel.objects.all())
        try:
            with triton_admin_client() as client:
                states = models_serving_states_sync(models=rows, client=client)
        except TritonError as error:
            logger.warning("admin: Triton's repository index unavailable: %s", error)
            return None
        return {row.pk: state for row, state in zip(rows, states, strict=True)}

    def save_model(self, request: HttpRequest, obj: EmbeddingModel, form, change: bool) -> None:
        super().save_model(request, obj, form, change)
        embedding_model_cache_clear()
        changed = set(form.changed_data) & {"triton_version", "enabled", "triton_model"}
        if changed:
            # A new version serves next to the old one until beat's reconcile drops the old.
            self._reconcile(request, [obj], unload="triton_version" not in changed)

    @admin.action(description="Load into Triton (enable)")
    def load_into_triton(self, request: HttpRequest, queryset: QuerySet[EmbeddingModel]) -> None:
        queryset.update(enabled=True)
        embedding_model_cache_clear()
        self._reconcile(request, list(queryset), unload=True)

    @admin.action(description="Unload from Triton (disable)")
    def unload_from_triton(self, request: HttpRequest, queryset: QuerySet[EmbeddingModel]) -> None:
        queryset.update(enabled=False)
        embedding_model_cache_clear()
        self._reconcile(request, list(queryset), unload=True)

    def _reconcile(self, request: HttpRequest, models: list[EmbeddingModel], *, unload: bool) -> None:
        from embeddings.services.inference.serving import models_reconcile

        names = {model.name for model in models}
        try:
            states = models_reconcile(unload=unload, triton_models={model.triton_model for model in models})
        except TritonError as error:
            self.message_user(
                request,
                f"Saved, but Triton did not answer ({type(error).__name__}); the change is applied "
                "when it does (beat reconciles every MODEL_RECONCILE_INTERVAL_S).",
                messages.WARNING,
            )
            return
        for state in states:
            if state.name not in names:
                continue
            enabled = next(model for model in models if model.name == state.name).enabled
            where = f"Triton model {state.triton_model} version {state.version or 'latest'}"
            if not enabled:
                self.message_user(request, f"{state.name}: disabled; {where} unloaded.", messages.SUCCESS)
            elif state.ready:
                self.message_user(request, f"{state.name}: {where} is loaded and serving.", messages.SUCCESS)
            else:
                reason = state.reason or state.state or "not loaded"
                self.message_user(request, f"{state.name}: {where} did not load: {reason}", messages.ERROR)


class EchoBuffer:
    """csv.writer writes each row here and gets the line back, for a streamed response."""

    def write(self, line: str) -> str:
        return line


# CSV lines read from the database per step of the streamed response.
CSV_LINES_PER_PIECE = 500


async def csv_pieces(lines: Iterator[str]) -> AsyncIterator[str]:
    """The lines in pieces, each read in the request's own thread (its database connection and
    cursor). Django's ASGI handler would read a plain iterator whole into memory before sending
    the first byte: the download would not be streamed at all under uvicorn."""
    read_piece = sync_to_async(lambda: "".join(itertools.islice(lines, CSV_LINES_PER_PIECE)))
    while piece := await read_piece():
        yield piece


def usage_csv_response(queryset: QuerySet[UsageBucket], filename: str) -> StreamingHttpResponse:
    writer = csv.writer(EchoBuffer())
    lines = (writer.writerow(row) for row in usage_csv_rows(queryset))
    response = StreamingHttpResponse(csv_pieces(lines), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


@admin.register(UsageBucket)
class UsageBucketAdmin(admin.ModelAdmin):
    """Usage per tenant, key, model variant, endpoint and UTC hour; read-only (only the usage fold
    writes rows)."""

    list_display = (
        "hour",
        "tenant",
        "api_key",
        "model",
        "model_version",
        "model_dtype",
        "endpoint",
        "requests",
        "succeeded",
        "rejected",
        "failed",
        "inputs",
        "tokens",
        "cached_tokens",
        "mean_latency_ms",
    )
    list_filter = (
        "tenant",
        ("api_key", admin.RelatedOnlyFieldListFilter),
        "model",
        "model_dtype",
        "endpoint",
    )
    list_select_related = ("tenant", "api_key")
    date_hierarchy = "hour"
    search_fields = ("tenant__name", "tenant__slug", "api_key__name", "api_key__public_id", "model")
    list_per_page = 100
    actions = ("export_csv",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: UsageBucket | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: UsageBucket | None = None) -> bool:
        return False

    @admin.display(description="mean latency (ms)")
    def mean_latency_ms(self, bucket: UsageBucket) -> str:
        return f"{bucket.latency_ms_total / bucket.requests:.1f}" if bucket.requests else "-"

    def get_urls(self):
        csv_url = path("csv/", self.admin_site.admin_view(self.csv_view), name="embeddings_usagebucket_csv")
        return [csv_url, *super().get_urls()]

    def csv_view(self, request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
        """The changelist's rows as CSV: the same filters, search and date drill-down, all pages."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters:
            return HttpResponseBadRequest("Unknown filter in the query string.")
        return usage_csv_response(changelist.queryset, self.csv_filename())

    @admin.action(description="Download selected rows as CSV")
    def export_csv(self, request: HttpRequest, queryset: QuerySet[UsageBucket]) -> StreamingHttpResponse:
        return usage_csv_response(queryset.order_by("-hour", "pk"), self.csv_filename())

    def csv_filename(self) -> str:
        return f"usage-{timezone.now():%Y%m%dT%H%M%SZ}.csv"


import embeddings.admin_batches  # noqa: E402 -- the batches and files pages register themselves
import embeddings.admin_jobs  # noqa: E402, F401 -- the jobs pages register themselves
from embeddings import admin_overview  # noqa: E402, F401 -- the operations overview, linked from the index
