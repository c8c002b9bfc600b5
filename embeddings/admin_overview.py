"""The admin's operations overview (/admin/operations/, linked from the admin's index): per model,
Triton's state on each replica and the last minute's requests, tokens, refusals, errors and p50/p99
latency, with requests a minute for the last ten minutes; the tenants with most tokens today and
most refusals in the last hour; the job backlog by state; each Redis server's memory against its
limit.

Thin: one call of embeddings/services/operations/overview.py, rendered, each section showing its
own error when its source is down; charts are admin_charts' inline SVG (no script, no CDN). Staff
who may view tenants (the view or change permission) see it; other staff get 403, and anyone not
staff the login page.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

from embeddings.admin_charts import Bar, bar_chart

# The overview's service (Triton's client, Redis, the jobs wing) is imported by the view, not here:
# every process imports the admin at start-up, and most never render an admin page (admin.py says so).
if TYPE_CHECKING:
    from embeddings.services.operations.overview import ModelRow, OperationsOverview

# Who may see the page: staff holding either (a superuser holds every permission).
OVERVIEW_PERMISSIONS = ("embeddings.view_tenant", "embeddings.change_tenant")
TEMPLATE = "admin/embeddings/operations_overview.html"
# The top tenants chart's labels: a slug cut to fit under its bar (the full name is the bar's title).
LABEL_CHARACTERS = 11

# The admin's index links here (embeddings/templates/admin/embeddings/index.html).
admin.site.index_template = "admin/embeddings/index.html"


def may_view_operations(user) -> bool:
    return user.is_active and user.is_staff and any(user.has_perm(name) for name in OVERVIEW_PERMISSIONS)


def _milliseconds(value: float | None) -> str:
    from embeddings.services.quotas.activity import LATENCY_BOUNDS_MS

    if value is None:
        return "—"
    # Past the histogram's last bound all it can say is "at least".
    return f"≥ {value:,.0f} ms" if value >= LATENCY_BOUNDS_MS[-1] else f"{value:,.0f} ms"


def _model_rows(overview: OperationsOverview) -> list[dict]:
    rows = []
    for index, model in enumerate(overview.models):
        minute = model.last_minute
        rows.append(
            {
                "name": model.name,
                "triton_model": model.triton_model,
                "version": model.version or "latest",
                "enabled": model.enabled,
                "replicas": [_replica_cell(state) for state in model.replica_states],
                "requests": f"{minute.requests:,}",
                "tokens": f"{minute.tokens:,}",
                "refused": f"{minute.refused:,}",
                "errors": f"{minute.errors:,}",
                "p50": _milliseconds(minute.p50_ms),
                "p99": _milliseconds(minute.p99_ms),
                "chart": _requests_chart(overview, model, index),
            }
        )
    return rows


def _replica_cell(state) -> dict:
    if state is None:
        return {"text": "—", "css": "state-unknown", "reason": "this replica did not answer"}
    text = state.state or "not loaded"
    return {"text": text, "css": "state-ready" if state.ready else "state-not-ready", "reason": state.reason}


def _requests_chart(overview: OperationsOverview, model: ModelRow, index: int) -> SafeString:
    last = len(overview.minutes) - 1
    bars = [
        Bar(
            key=f"{moment:%H:%M}",
            label="now" if position == last else f"{moment:%H:%M}",
            value=minute.requests,
            tooltip=f"{moment:%H:%M} UTC{' (so far)' if position == last else ''}",
        )
        for position, (moment, minute) in enumerate(zip(overview.minutes, model.minutes, strict=True))
    ]
    return bar_chart(
        title=f"Requests per minute: {model.name}",
        description=(
            f"Requests to {model.name} in each of the last {last} minutes and the current one, "
            "every web process's, oldest first."
        ),
        bars=bars,
        unit="requests",
        chart_id=f"requests-chart-{index}",
        key_name="minute",
        axis_label="minute (UTC); the last is the current one, so far",
        value_label="requests per minute",
        label_every=2,
    )


def _tokens_chart(overview: OperationsOverview) -> SafeString:
    bars = [
        Bar(
            key=tenant.slug or str(tenant.tenant_id),
            label=(tenant.slug or str(tenant.tenant_id))[:LABEL_CHARACTERS],
            value=tenant.tokens,
            tooltip=tenant.name,
        )
        for tenant in overview.tenants_by_tokens
    ]
    return bar_chart(
        title="Tokens today (UTC), top tenants",
        description="The tenants that used most tokens since midnight UTC, most first.",
        bars=bars,
        unit="tokens",
        chart_id="top-tenants-chart",
        key_name="tenant",
        axis_label="tenant",
        value_label="tokens today",
    )


def _tenant_rows(overview: OperationsOverview) -> tuple[list[dict], list[dict]]:
    """The top tenants by tokens today, and by refusals in the last hour."""
    by_tokens = [
        {
            "tenant_id": tenant.tenant_id,
            "name": tenant.name,
            "slug": tenant.slug,
            "tokens": f"{tenant.tokens:,}",
            "requests": f"{tenant.requests:,}",
        }
        for tenant in overview.tenants_by_tokens
    ]
    by_refusals = [
        {
            "tenant_id": tenant.tenant_id,
            "name": tenant.name,
            "slug": tenant.slug,
            "refused": f"{tenant.refused:,}",
            "by_limit": [(level, limit, f"{count:,}") for level, limit, count in tenant.by_limit],
        }
        for tenant in overview.tenants_by_refusals
    ]
    return by_tokens, by_refusals


def _backlog_rows(overview: OperationsOverview) -> list[dict]:
    if overview.backlog is None:
        return []
    jobs = reverse("admin:embeddings_embeddingjob_changelist")
    return [
        {"status": status, "jobs": f"{count:,}", "url": f"{jobs}?status={status}"}
        for status, count in overview.backlog.jobs_by_status.items()
    ]


def _redis_rows(overview: OperationsOverview) -> list[dict]:
    rows = []
    for server in overview.redis_servers:
        memory = server.memory
        row = {"role": server.role, "error": server.error}
        if memory is not None:
            percent = memory.percent_of_max
            row |= {
                "used": memory.used_bytes,
                "max": memory.max_bytes,
                "percent": None if percent is None else f"{percent:.1f}",
                "meter": None if percent is None else f"{min(percent, 100.0):.1f}",
                "policy": memory.policy,
                "evicted": f"{memory.evicted_keys:,}",
                "peak": memory.peak_bytes,
            }
        rows.append(row)
    return rows


def operations_overview_page(request: HttpRequest) -> HttpResponse:
    """The page: staff who may view tenants only (403 for other staff)."""
    if not may_view_operations(request.user):
        raise PermissionDenied
    from embeddings.services.operations.overview import operations_overview

    overview = operations_overview()
    backlog = overview.backlog
    tenants_by_tokens, tenants_by_refusals = _tenant_rows(overview)
    context = {
        **admin.site.each_context(request),
        "title": "Operations overview",
        "overview": overview,
        "model_rows": _model_rows(overview),
        "last_minute": overview.minutes[-2] if len(overview.minutes) > 1 else None,
        "last_minute_end": overview.minutes[-1] if overview.minutes else None,
        "model_columns": 8 + len(overview.replicas),
        "tenants_by_tokens": tenants_by_tokens,
        "tenants_by_refusals": tenants_by_refusals,
        "tokens_chart": _tokens_chart(overview) if overview.tenants_by_tokens else None,
        "backlog_rows": _backlog_rows(overview),
        "inputs_pending": None if backlog is None else f"{backlog.inputs_pending:,}",
        "oldest_active": None
        if backlog is None or not backlog.oldest_age_s
        else timesince(overview.taken_at - timedelta(seconds=backlog.oldest_age_s), overview.taken_at),
        "redis_rows": _redis_rows(overview),
        "read_ms": overview.read_ms,
    }
    return TemplateResponse(request, TEMPLATE, context)


# Every admin view's wrapping: the login page for anyone not active staff, never cached, CSRF-checked.
operations_overview_view = admin.site.admin_view(operations_overview_page)
