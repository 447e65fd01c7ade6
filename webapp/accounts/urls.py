from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from webapp.accounts import views

urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="accounts/login.html", redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api-keys/", views.api_key_list, name="api_keys"),
    path("api-keys/<int:api_key_id>/revoke", views.api_key_revoke, name="api_key_revoke"),
]
