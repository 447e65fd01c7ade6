from __future__ import annotations

from django.contrib import admin

from webapp.accounts.models import ApiKey, Invite


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "user", "prefix", "created_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix", "user__username")
    readonly_fields = ("prefix", "key_sha256", "created_at", "last_used_at")


@admin.register(Invite)
class InviteAdmin(admin.ModelAdmin):
    list_display = ("__str__", "created_by", "created_at", "expires_at", "used_at", "used_by")
    search_fields = ("username", "email", "created_by__username")
    readonly_fields = ("token_sha256", "created_at", "used_at", "used_by")
