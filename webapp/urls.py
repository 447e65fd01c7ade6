from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from webapp import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("accounts/", include("webapp.accounts.urls")),
    path("documents/", include("webapp.documents.urls")),
    path("chat/", include("webapp.chat.urls")),
    path("admin/", admin.site.urls),
    path("", RedirectView.as_view(pattern_name="chat:index"), name="home"),
]
