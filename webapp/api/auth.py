"""Who is calling: an API key (``Authorization: Bearer``), or the browser's session.

A key's owner becomes ``request.user``, so the views read the same either way. Each user has
one rate limit over all their keys and their session (``accounts.ratelimits``); over it, 429
with ``Retry-After``."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer, SessionAuth

from webapp.accounts.ratelimits import user_seconds_until_allowed
from webapp.accounts.services import api_key_authenticate
from webapp.api.errors import ApiError


def check_rate_limit(request: HttpRequest, user) -> None:
    retry_after = user_seconds_until_allowed(request, user)
    if retry_after is not None:
        raise ApiError(
            429,
            "rate_limited",
            f"You are over your rate limit; retry in {retry_after} s.",
            {"Retry-After": str(retry_after)},
        )


class ApiKeyAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        api_key = api_key_authenticate(plaintext=token)
        if api_key is None:
            return None
        check_rate_limit(request, api_key.user)
        request.user = api_key.user
        return api_key


class RateLimitedSessionAuth(SessionAuth):
    """The browser's session (with ninja's CSRF check), under the same per-user limit.

    Who is calling is decided before CSRF: a request that sends a key (valid or not), or that
    has no signed-in session, is not the browser's, so it gets the 401 of a bad or missing
    key rather than ninja's "CSRF check Failed" 403 (seen on ``POST /api/v1/query``)."""

    def __call__(self, request: HttpRequest) -> Any:
        if "Authorization" in request.headers or not request.user.is_authenticated:
            return None
        return super().__call__(request)

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        user = super().authenticate(request, key)
        if user is not None:
            check_rate_limit(request, user)
        return user


API_AUTH = [ApiKeyAuth(), RateLimitedSessionAuth()]
