"""Django admin: tenants with their keys, API keys (the secret shown once, at creation), models.

Thin: creating, revoking and deactivating go through the services the API and commands use.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html

from embeddings.models import ApiKey, EmbeddingModel, Tenant
from embeddings.services.keys import api_key_create, api_key_revoke
from embeddings.services.tenants import tenant_deactivate

API_KEY_READONLY_FIELDS = ("public_id", "secret_hash", "created_at", "revoked_at", "last_used_at")


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
    readonly_fields = ("created_at", "add_key_link")
    fields = ("name", "slug", "is_active", "allow_all_models", "allowed_models", "created_at", "add_key_link")
    inlines = (ApiKeyInline,)
    actions = ("deactivate_tenants",)

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

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> tuple[str, ...]:
        if obj is None:
            return ()
        return ("tenant", *API_KEY_READONLY_FIELDS)

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


@admin.register(EmbeddingModel)
class EmbeddingModelAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "aliases",
        "triton_model",
        "triton_version",
        "dimensions",
        "max_tokens",
        "enabled",
    )
    list_filter = ("enabled", "triton_model")
    search_fields = ("name", "triton_model")
    readonly_fields = ("created_at",)
