"""Django admin for the dashboard's models, and for chat's (which has no admin module).

Read-only where an edit would break consistency: an answer's measurements, request id and
citations are what the worker reported; an audit's scores are computed from its texts."""

from __future__ import annotations

from django.contrib import admin

from webapp.chat.models import Citation, Conversation, Message
from webapp.dashboard.models import DashboardSettings, FidelityAudit


@admin.register(DashboardSettings)
class DashboardSettingsAdmin(admin.ModelAdmin):
    list_display = (
        "__str__",
        "controller_mode",
        "fixed_recompute_ratio",
        "audit_sample_rate",
        "updated_at",
        "updated_by",
    )
    readonly_fields = ("updated_at", "updated_by")

    def has_add_permission(self, request) -> bool:  # the singleton is created on first use
        return not DashboardSettings.objects.exists()

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(FidelityAudit)
class FidelityAuditAdmin(admin.ModelAdmin):
    list_display = (
        "message",
        "status",
        "token_f1",
        "blend_recompute_ratio",
        "blend_ttft_s",
        "full_ttft_s",
        "created_at",
        "completed_at",
    )
    list_filter = ("status",)
    raw_id_fields = ("message",)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class MessageInline(admin.TabularInline):
    model = Message
    fields = ("role", "status", "mode", "content", "ttft_s", "created_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ("title", "owner", "created_at", "updated_at")
    search_fields = ("title", "owner__username")
    raw_id_fields = ("owner",)
    readonly_fields = ("created_at", "updated_at")
    inlines = [MessageInline]


class CitationInline(admin.TabularInline):
    model = Citation
    fields = ("rank", "document_title", "chunk", "tier", "text")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Message)
class MessageAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "conversation",
        "role",
        "status",
        "mode",
        "recompute_ratio",
        "ttft_s",
        "feedback",
        "created_at",
    )
    list_filter = ("role", "status", "mode", "feedback")
    search_fields = ("content", "request_id", "conversation__owner__username")
    raw_id_fields = ("conversation",)
    # What the worker measured and reported: editing it would falsify the metrics.
    readonly_fields = (
        "conversation",
        "role",
        "request_id",
        "mode",
        "recompute_ratio",
        "ttft_s",
        "total_s",
        "prompt_tokens",
        "completion_tokens",
        "tiers",
        "created_at",
        "completed_at",
    )
    inlines = [CitationInline]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Citation)
class CitationAdmin(admin.ModelAdmin):
    list_display = ("message", "rank", "document_title", "tier")
    list_filter = ("tier",)
    search_fields = ("document_title", "text")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
