"""Request tokens: how an inference worker reading KV through the knowledge delivery API
(``KV_SOURCE=kdn``) is allowed to, without a key of its own.

The web app signs one token per question it sends (``django.core.signing`` with the
deployment's ``SECRET_KEY``), naming the asking user and the request id and expiring with the
request's timeout; the worker sends it back as ``Authorization: Bearer <token>`` on
``POST /kdn/v1/fetch``, which then reads in that user's scope exactly as their API key would.
A worker so holds no secret: a token it leaks opens one user's KV, for minutes, and only to
fetch (not to store or delete). The ``salt`` keeps these signatures apart from every other
use of ``SECRET_KEY`` (sessions, password resets): no other signed value passes as a token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.core import signing

SALT = "ragblend.kdn.request-token"


@dataclass(frozen=True)
class RequestToken:
    user_id: int
    request_id: str
    expires_at: float  # Unix time


def request_token(*, user_id: int, request_id: str, timeout_s: float) -> str:
    """A token for ``user_id``'s request ``request_id``, valid for ``timeout_s`` seconds."""
    # to the millisecond, rounded down: the token never outlives the request
    expires = math.floor((time.time() + timeout_s) * 1000) / 1000
    payload = {"u": user_id, "r": request_id, "e": expires}
    return signing.dumps(payload, salt=SALT, compress=False)


def token_claims(token: str) -> RequestToken | None:
    """What a token says, or None when it is forged, mangled or expired."""
    try:
        payload = signing.loads(token, salt=SALT)
        claims = RequestToken(int(payload["u"]), str(payload["r"]), float(payload["e"]))
    except (signing.BadSignature, KeyError, TypeError, ValueError):
        return None
    return claims if claims.expires_at > time.time() else None


def token_user(token: str):
    """The active user a valid token was signed for, else None."""
    claims = token_claims(token)
    if claims is None:
        return None
    return get_user_model().objects.filter(pk=claims.user_id, is_active=True).first()
