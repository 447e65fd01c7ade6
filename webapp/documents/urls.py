from __future__ import annotations

from django.urls import path

from webapp.documents import views

app_name = "documents"

urlpatterns = [
    path("", views.document_list, name="list"),
    path("<int:document_id>/", views.document_detail, name="detail"),
    path("<int:document_id>/download", views.document_download, name="download"),
    path("<int:document_id>/retry", views.document_retry, name="retry"),
    path("<int:document_id>/delete", views.document_delete, name="delete"),
]
