"""Reads for accounts."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from webapp.accounts.models import ApiKey


def api_key_list(*, user) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(user=user).order_by("-created_at", "-id")


def api_key_get(*, user, api_key_id: int) -> ApiKey | None:
    return ApiKey.objects.filter(user=user, pk=api_key_id).first()


def user_list() -> QuerySet:
    return get_user_model().objects.order_by("username")
