"""Reads for accounts."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from webapp import outages
from webapp.accounts.models import ApiKey, Invite, secret_sha256
from webapp.accounts.ratelimits import account_locks

log = logging.getLogger(__name__)


def api_key_list(*, user) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(user=user).order_by("-created_at", "-id")


def api_key_get(*, user, api_key_id: int) -> ApiKey | None:
    return ApiKey.objects.filter(user=user, pk=api_key_id).first()


def user_list() -> QuerySet:
    return get_user_model().objects.order_by("username")


def user_list_with_login_locks() -> list:
    """Every user, by username, each with ``login_locked_until``: when the lock on their
    password logins ends (``ratelimits.lock_accounts``), or None. With the cache down nobody
    reads as locked, and that is logged: the page still lists the users."""
    users = list(user_list())
    try:
        locks = account_locks(user.get_username() for user in users)
    except outages.SERVICE_ERRORS as err:
        log.warning("login locks are not shown, the cache is down: %s", err)
        locks = {}
    for user in users:
        until = locks.get(user.get_username())
        user.login_locked_until = None if until is None else datetime.fromtimestamp(until, UTC)
    return users


INVITES_LISTED = 50


def invite_list() -> QuerySet[Invite]:
    """The latest invites, for the staff's invites page."""
    return Invite.objects.select_related("created_by", "used_by").order_by("-created_at", "-id")[
        :INVITES_LISTED
    ]


def invite_get(*, token: str) -> Invite | None:
    """The invite with this token, whatever its state (a token is at most a few dozen
    characters: anything longer is no invite's)."""
    if not token or len(token) > 100:
        return None
    return Invite.objects.filter(token_sha256=secret_sha256(token)).first()
