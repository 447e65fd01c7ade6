from __future__ import annotations

from django.contrib import admin

from webapp.documents.models import Chunk, Collection, Document


@admin.register(Document)
class DocumentAdmin(admin.ModelAdmin):
    list_display = (
        "title",
        "owner",
        "detected_type",
        "size_bytes",
        "status",
        "stage",
        "progress",
        "created_at",
    )
    list_filter = ("status", "stage", "detected_type")
    search_fields = ("title", "original_name", "content_sha256", "owner__username")
    readonly_fields = ("content_sha256", "object_key", "created_at", "updated_at", "ready_at")
    raw_id_fields = ("owner",)


@admin.register(Chunk)
class ChunkAdmin(admin.ModelAdmin):
    list_display = ("document", "index", "token_count", "kv_status", "kv_key")
    list_filter = ("kv_status",)
    search_fields = ("token_ids_sha256", "kv_key")
    raw_id_fields = ("document",)
    exclude = ("embedding", "search_vector", "token_ids")
    readonly_fields = ("token_count", "token_ids_sha256", "kv_key")


@admin.register(Collection)
class CollectionAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "updated_at")
    search_fields = ("name", "owner__username")
    raw_id_fields = ("owner", "documents", "shared_with")
