"""Request tokens: how an inference worker reading KV through the knowledge delivery API
(``KV_SOURCE=kdn``) is allowed to, without a key of its own.

With ``KV_SOURCE=kdn`` the web app signs a token for each passage of a question it sends
(``django.core.signing`` with the deployment's ``SECRET_KEY``): the asking user, the request
id, the sha256 of the texts it may fetch (the passage's, one) and an expiry, at most
``KDN_TOKEN_TTL_S`` and the request's timeout. The worker sends it back as
``Authorization: Bearer <token>`` on ``POST /kdn/v1/fetch``, which then fetches those texts
and nothing else, in that user's reach, under a per-user rate limit (``webapp.kdn.api``).
The digests are inside the signature, so a holder cannot widen the token; a leaked one
fetches the KV of one passage its user may read, for a minute or two. The ``salt`` keeps these
signatures apart from every other use of ``SECRET_KEY`` (sessions, password resets): no
other signed value passes as a token.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import signing

SALT = "ragblend.kdn.request-token"


def text_digest(text: str) -> str:
    """What a token names a text by: the sha256 of its UTF-8 (a lone surrogate, which the API
    refuses before, is hashed as it is rather than raising)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class RequestToken:
    user_id: int
    request_id: str
    expires_at: float  # Unix time
    text_digests: frozenset[str]

    def first_outside(self, texts: Sequence[str]) -> int | None:
        """The index of the first text this token may not fetch; None when it may fetch all."""
        for index, text in enumerate(texts):
            if text_digest(text) not in self.text_digests:
                return index
        return None


def request_token(*, user_id: int, request_id: str, texts: Iterable[str], timeout_s: float) -> str:
    """A token that fetches ``texts`` as ``user_id``, for request ``request_id``: valid for
    ``timeout_s`` seconds (the request's timeout) or ``KDN_TOKEN_TTL_S``, the shorter."""
    lifetime_s = min(timeout_s, settings.KDN_TOKEN_TTL_S)
    # to the millisecond, rounded down: the token never outlives the request
    expires = math.floor((time.time() + lifetime_s) * 1000) / 1000
    digests = sorted({text_digest(text) for text in texts})
    payload = {"u": user_id, "r": request_id, "e": expires, "t": digests}
    return signing.dumps(payload, salt=SALT, compress=False)


def token_claims(token: str) -> RequestToken | None:
    """What a token says, or None when it is forged, mangled, expired or names no text."""
    try:
        payload = signing.loads(token, salt=SALT)
        digests = payload["t"]
        if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            return None
        claims = RequestToken(
            int(payload["u"]), str(payload["r"]), float(payload["e"]), frozenset(digests)
        )
    except (signing.BadSignature, KeyError, TypeError, ValueError):
        return None
    return claims if claims.expires_at > time.time() and claims.text_digests else None


def token_user(claims: RequestToken):
    """The active user a valid token was signed for, else None."""
    return get_user_model().objects.filter(pk=claims.user_id, is_active=True).first()
