"""Who is calling: an API key (``Authorization: Bearer``), or the browser's session.

A key's owner becomes ``request.user``, so the views read the same either way. Each key has
a rate limit (a fixed window in Redis); over it, 429 with ``Retry-After``."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer, django_auth

from webapp.accounts.services import api_key_authenticate, api_key_rate_limit
from webapp.api.errors import ApiError


class ApiKeyAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        api_key = api_key_authenticate(plaintext=token)
        if api_key is None:
            return None
        retry_after = api_key_rate_limit(api_key=api_key)
        if retry_after is not None:
            raise ApiError(
                429,
                "rate_limited",
                f"This key is over its rate limit; retry in {retry_after} s.",
                {"Retry-After": str(retry_after)},
            )
        request.user = api_key.user
        return api_key


API_AUTH = [ApiKeyAuth(), django_auth]
