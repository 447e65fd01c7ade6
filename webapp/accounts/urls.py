from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from webapp.accounts import views

urlpatterns = [
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("signup/", views.signup, name="signup"),
    path("password/", views.PasswordChangeView.as_view(), name="password_change"),
    path(
        "password/done/",
        auth_views.PasswordChangeDoneView.as_view(
            template_name="accounts/password_change_done.html"
        ),
        name="password_change_done",
    ),
    path("users/", views.user_list, name="users"),
    path("users/<int:user_id>/unlock", views.user_unlock, name="user_unlock"),
    path("invites/", views.invite_list, name="invites"),
    path("invites/<int:invite_id>/withdraw", views.invite_withdraw, name="invite_withdraw"),
    path("invite/<str:token>/", views.invite_accept, name="invite_accept"),
    path("api-keys/", views.api_key_list, name="api_keys"),
    path("api-keys/<int:api_key_id>/revoke", views.api_key_revoke, name="api_key_revoke"),
]
