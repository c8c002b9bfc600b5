"""What the admin's operator pages share (jobs, batches): rows the API and the engine own, shown
read-only, each with action buttons POSTed to `<id>/act/<action>/` (the model admin's act_view) and
the same actions on the list, every outcome said as a message.

Nothing is added, edited or deleted through these pages: a saved copy of a row could overwrite what
the engine wrote since. Staff who may only view see everything but no action; an action they POST
anyway, through either door, is refused with 403 (Django itself would only say "No action
selected" on the list).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.urls import path

# A bulk action's refusals listed one by one up to this many, then counted.
REFUSALS_LISTED = 10


class StatusFilter(admin.SimpleListFilter):
    """Status, with "active" (not final yet) first: what a paged operator looks for. A subclass names
    its `statuses` (a TextChoices), the `active` ones and how `active_label` spells them."""

    title = "status"
    parameter_name = "status"
    statuses: type
    active: tuple[str, ...]
    active_label: str

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("active", self.active_label), *self.statuses.choices]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "active":
            return queryset.filter(status__in=self.active)
        if self.value() in self.statuses.values:
            return queryset.filter(status=self.value())
        return queryset


@dataclass(frozen=True)
class ActionOutcome:
    done: bool
    text: str  # what was done (logged), or why not


class OperatorPagesAdmin(admin.ModelAdmin):
    """Read-only pages with operator actions. A subclass gives `fieldsets` (every field read-only),
    `page_context` (what its page shows beyond the row) and `act_view` (its buttons)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj=None) -> list[str]:
        return [name for _, options in self.fieldsets for name in options["fields"]]

    def get_urls(self):
        act = self.admin_site.admin_view(self.act_view)
        name = f"{self.opts.app_label}_{self.opts.model_name}_act"
        return [path("<path:object_id>/act/<str:action>/", act, name=name), *super().get_urls()]

    def act_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        raise NotImplementedError

    def page_context(self, request: HttpRequest, obj) -> dict:
        return {}

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None):
        if request.method == "POST":  # nothing here is saved: a stale copy would overwrite the engine's
            return HttpResponseNotAllowed(["GET"])
        obj = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if obj is not None:
            context |= self.page_context(request, obj)
        context |= {
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
            "show_delete": False,
        }
        return super().change_view(request, object_id, form_url, context)

    def changelist_view(self, request: HttpRequest, extra_context=None):
        # Django ignores an action the user may not run ("No action selected"): refuse it instead.
        if request.method == "POST" and "action" in request.POST and not self.has_change_permission(request):
            raise PermissionDenied
        return super().changelist_view(request, extra_context)

    def message_outcomes(
        self, request: HttpRequest, outcomes: list[ActionOutcome], *, done_text: str
    ) -> None:
        """A bulk action's outcomes: one's own text alone; of several, `done_text` (formatted with
        `done` and `total`) and each refusal, up to REFUSALS_LISTED."""
        done = [outcome for outcome in outcomes if outcome.done]
        refused = [outcome for outcome in outcomes if not outcome.done]
        if len(outcomes) == 1:
            self.message_user(request, outcomes[0].text, messages.SUCCESS if done else messages.WARNING)
            return
        if done:
            self.message_user(
                request, done_text.format(done=len(done), total=len(outcomes)), messages.SUCCESS
            )
        for outcome in refused[:REFUSALS_LISTED]:
            self.message_user(request, outcome.text, messages.WARNING)
        if len(refused) > REFUSALS_LISTED:
            self.message_user(
                request, f"… and {len(refused) - REFUSALS_LISTED} more refused.", messages.WARNING
            )
