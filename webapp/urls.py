from __future__ import annotations

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from webapp import health
from webapp.accounts.ratelimits import limit_posts, lock_accounts
from webapp.api.openai import openai_api
from webapp.api.v1 import api as api_v1
from webapp.kdn.api import kdn_api

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("livez", health.livez, name="livez"),
    path("readyz", health.readyz, name="readyz"),
    path("accounts/", include("webapp.accounts.urls")),
    path("documents/", include("webapp.documents.urls")),
    path("chat/", include("webapp.chat.urls")),
    path("dashboard/", include("webapp.dashboard.urls")),
    path("api/v1/", api_v1.urls),
    path("v1/", openai_api.urls),  # OpenAI-compatible
    path("kdn/v1/", kdn_api.urls),  # knowledge delivery (docs/kdn.md)
    # Admin's login page counts against the same per-address limit as ours, and locks accounts.
    path("admin/login/", limit_posts("login")(lock_accounts(admin.site.login))),
    path("admin/", admin.site.urls),
    path("", RedirectView.as_view(pattern_name="chat:index"), name="home"),
    # Pages name their icon; a client that asks the conventional path anyway gets it too.
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
]
