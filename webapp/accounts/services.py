"""Writes for accounts: users (added by staff or signing up), API keys (create, revoke,
authenticate) and their rate limit."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.utils import timezone

from webapp.accounts.models import ApiKey
from webapp.redis import redis_client

KEY_PREFIX = "rbk_"  # recognisable in logs and secret scanners
PREFIX_CHARS = 12  # "rbk_" + 8 random characters, shown in the key list
LAST_USED_RESOLUTION = timedelta(minutes=1)  # don't write the row on every request


GENERATED_PASSWORD_BYTES = 12  # 16 URL-safe characters


class UserCreateError(ValueError):
    """A new user's details that staff (or the person signing up) can fix; shown as is."""


def user_create(*, username: str, email: str = "", password: str = "") -> tuple[object, str]:
    """A new active, non-staff user; a blank ``password`` is generated. Returns the user and
    the password, which is shown once to whoever created the account and never stored in
    clear."""
    User = get_user_model()
    username, email = username.strip(), email.strip()
    errors: list[str] = []
    try:
        User.username_validator(username)
    except ValidationError as err:
        errors += err.messages
    if not username:
        errors = ["Give the user a username."]
    elif User.objects.filter(username__iexact=username).exists():
        errors.append(f"The username “{username}” is taken.")
    if email:
        try:
            validate_email(email)
        except ValidationError:
            errors.append(f"“{email}” is not an email address.")
    password = password or secrets.token_urlsafe(GENERATED_PASSWORD_BYTES)
    try:
        validate_password(password, User(username=username, email=email))
    except ValidationError as err:
        errors += err.messages
    if errors:
        raise UserCreateError(" ".join(errors))
    try:
        with transaction.atomic():
            user = User.objects.create_user(username=username, email=email, password=password)
    except IntegrityError as err:  # the same username created at the same moment
        raise UserCreateError(f"The username “{username}” is taken.") from err
    return user, password


class ApiKeyError(ValueError):
    """A request the user can fix (shown to them as is)."""


def _digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def api_key_create(*, user, name: str) -> tuple[ApiKey, str]:
    """A new key for ``user``; returns the row and the plaintext, which is never stored."""
    name = name.strip()
    if not name:
        raise ApiKeyError("Give the key a name (what will use it?).")
    if len(name) > 100:
        raise ApiKeyError("Key names are limited to 100 characters.")
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(
        user=user, name=name, prefix=plaintext[:PREFIX_CHARS], key_sha256=_digest(plaintext)
    )
    return api_key, plaintext


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke a key at once (idempotent: a revoked key keeps its first revocation time)."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


def api_key_authenticate(*, plaintext: str) -> ApiKey | None:
    """The active key with this plaintext (its user loaded), or None."""
    if not plaintext.startswith(KEY_PREFIX) or len(plaintext) > 200:
        return None
    digest = _digest(plaintext)
    api_key = (
        ApiKey.objects.select_related("user")
        .filter(prefix=plaintext[:PREFIX_CHARS], revoked_at=None, user__is_active=True)
        .filter(key_sha256=digest)
        .first()
    )
    if api_key is None or not hmac.compare_digest(api_key.key_sha256, digest):
        return None
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now
    return api_key


def user_rate_limit(*, user) -> int | None:
    """Count one request against the user's fixed window in Redis (every key, the session
    and the browser's questions share it); returns None when it is allowed, or the seconds
    until the window resets when the user is over the limit."""
    limit = settings.API_RATE_LIMIT_REQUESTS
    window = settings.API_RATE_LIMIT_WINDOW_S
    now = time.time()
    window_start = int(now // window) * window
    name = f"ragblend:ratelimit:user:{user.pk}:{window_start}"
    pipe = redis_client().pipeline()
    pipe.incr(name)
    pipe.expire(name, window + 1)
    count, _ = pipe.execute()
    if count <= limit:
        return None
    return max(1, int(window_start + window - now + 0.999))
