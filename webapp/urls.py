from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from webapp import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("accounts/", include("webapp.accounts.urls")),
    path("admin/", admin.site.urls),
    path("", health.home, name="home"),
]
