from __future__ import annotations

from django.urls import path

from webapp.dashboard import views

app_name = "dashboard"

urlpatterns = [
    path("", views.index, name="index"),
    path("controller", views.controller, name="controller"),
    path("audit", views.audit, name="audit"),
    path("documents/<int:document_id>/evict", views.document_evict, name="document_evict"),
    path("documents/<int:document_id>/warm", views.document_warm, name="document_warm"),
    path(
        "documents/<int:document_id>/precompute",
        views.document_precompute,
        name="document_precompute",
    ),
]
