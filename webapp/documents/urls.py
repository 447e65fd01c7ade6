from __future__ import annotations

from django.urls import path

from webapp.documents import collections, views

app_name = "documents"

urlpatterns = [
    path("", views.document_list, name="list"),
    path("<int:document_id>/", views.document_detail, name="detail"),
    path("<int:document_id>/download", views.document_download, name="download"),
    path("<int:document_id>/rename", views.document_rename, name="rename"),
    path("<int:document_id>/retry", views.document_retry, name="retry"),
    path("<int:document_id>/delete", views.document_delete, name="delete"),
    path(
        "<int:document_id>/collections",
        collections.document_collections,
        name="document_collections",
    ),
    path("collections/", collections.collection_list, name="collections"),
    path("collections/<int:collection_id>/", collections.collection_detail, name="collection"),
    path(
        "collections/<int:collection_id>/rename",
        collections.collection_rename,
        name="collection_rename",
    ),
    path(
        "collections/<int:collection_id>/documents",
        collections.collection_documents,
        name="collection_documents",
    ),
    path(
        "collections/<int:collection_id>/share",
        collections.collection_share,
        name="collection_share",
    ),
    path(
        "collections/<int:collection_id>/delete",
        collections.collection_delete,
        name="collection_delete",
    ),
]
