"""Writes for accounts: users (added by staff, signing up, or through a staff member's invite),
the locks on their password logins, invites, API keys (create, revoke, authenticate) and their
rate limit."""

from __future__ import annotations

import hmac
import logging
import secrets
from datetime import timedelta

from axes.utils import reset as axes_reset
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.utils import timezone

from webapp import outages
from webapp.accounts.models import ApiKey, Invite, secret_sha256
from webapp.accounts.ratelimits import account_unlock

log = logging.getLogger(__name__)

KEY_PREFIX = "rbk_"  # recognisable in logs and secret scanners
PREFIX_CHARS = 12  # "rbk_" + 8 random characters, shown in the key list
LAST_USED_RESOLUTION = timedelta(minutes=1)  # don't write the row on every request


GENERATED_PASSWORD_BYTES = 12  # 16 URL-safe characters


class UserCreateError(ValueError):
    """A new user's details that staff (or the person signing up) can fix; shown as is."""


def _username_errors(username: str) -> list[str]:
    """What is wrong with a new account's username: blank, invalid or taken."""
    User = get_user_model()
    if not username:
        return ["Give the user a username."]
    errors: list[str] = []
    try:
        User.username_validator(username)
    except ValidationError as err:
        errors += err.messages
    if User.objects.filter(username__iexact=username).exists():
        errors.append(f"The username “{username}” is taken.")
    return errors


def _email_errors(email: str) -> list[str]:
    """What is wrong with a new account's email, if it has one."""
    if not email:
        return []
    try:
        validate_email(email)
    except ValidationError:
        return [f"“{email}” is not an email address."]
    return []


def user_create(*, username: str, email: str = "", password: str = "") -> tuple[object, str]:
    """A new active, non-staff user; a blank ``password`` is generated. Returns the user and
    the password, which is shown once to whoever created the account and never stored in
    clear."""
    User = get_user_model()
    username, email = username.strip(), email.strip()
    errors = _username_errors(username) + _email_errors(email)
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


def login_unlock(*, username: str) -> bool:
    """Lift every lock on ``username``'s password logins: the one per account
    (``ratelimits.lock_accounts``) and django-axes' per address, so they can log in again
    from anywhere now. Returns False, and logs why, when the cache or the database is down:
    then the locks end by themselves."""
    try:
        account_unlock(username)
        axes_reset(username=username)
    except outages.SERVICE_ERRORS as err:
        log.warning("the login locks of %r are not lifted, a service is down: %s", username, err)
        return False
    return True


# --- invites ---------------------------------------------------------------------------------

INVITE_TOKEN_BYTES = 32  # 43 URL-safe characters: not to be guessed
INVITE_MAX_DAYS = 90


class InviteError(ValueError):
    """An invite that cannot be made or used, in words for whoever is in front of it (and a
    heading for the page that says so)."""

    title = "This invite cannot be made"


class InviteNotFound(InviteError):
    """No invite has this token (mistyped, cut short, or never made)."""

    title = "This invite link is not valid"


class InviteUsed(InviteError):
    """The invite made its account already: each is used once."""

    title = "This invite link has been used"


class InviteExpired(InviteError):
    """The invite's time is over."""

    title = "This invite link has expired"


def invite_create(
    *, created_by, username: str = "", email: str = "", valid_days: int | None = None
) -> tuple[Invite, str]:
    """A new invite by staff member ``created_by``, valid ``valid_days`` (by default
    INVITE_VALID_DAYS), tied to ``username`` and ``email`` when given. Returns the invite and
    its token, which is shown once (in the link) and never stored in clear."""
    username, email = username.strip(), email.strip()
    days = settings.INVITE_VALID_DAYS if valid_days is None else valid_days
    errors = (_username_errors(username) if username else []) + _email_errors(email)
    if not 1 <= days <= INVITE_MAX_DAYS:
        errors.append(f"An invite is valid for 1 to {INVITE_MAX_DAYS} days.")
    if errors:
        raise InviteError(" ".join(errors))
    token = secrets.token_urlsafe(INVITE_TOKEN_BYTES)
    invite = Invite.objects.create(
        created_by=created_by,
        token_sha256=secret_sha256(token),
        username=username,
        email=email,
        expires_at=timezone.now() + timedelta(days=days),
    )
    return invite, token


def invite_check(invite: Invite | None) -> Invite:
    """The invite if it can still make an account; else why not (InviteError)."""
    if invite is None:
        raise InviteNotFound(
            "This invite link is not valid: check that you copied all of it, or ask for a new one."
        )
    if invite.state == Invite.State.USED:
        raise InviteUsed(
            "This invite link has been used already: log in with the account it made, or ask "
            "for a new one."
        )
    if invite.state == Invite.State.EXPIRED:
        raise InviteExpired(
            f"This invite link expired on {invite.expires_at:%Y-%m-%d %H:%M} UTC: ask for a new "
            "one."
        )
    return invite


def invite_withdraw(*, invite: Invite) -> bool:
    """Staff take back an invite nobody has used: it expires now (its link then says so).
    Returns whether it was withdrawn; a used or expired invite is left as it is."""
    now = timezone.now()
    return bool(
        Invite.objects.filter(pk=invite.pk, used_at__isnull=True, expires_at__gt=now).update(
            expires_at=now
        )
    )


@transaction.atomic
def invite_accept(*, token: str, username: str, password: str):
    """Make the account of the invite with ``token`` (its own username, if it has one) and
    mark the invite used, once: two acceptances at the same moment wait on its row lock,
    and the second finds it used. Returns the new user."""
    invite = invite_check(
        Invite.objects.select_for_update().filter(token_sha256=secret_sha256(token)).first()
    )
    user, _ = user_create(
        username=invite.username or username, email=invite.email, password=password
    )
    Invite.objects.filter(pk=invite.pk).update(used_at=timezone.now(), used_by=user)
    return user


class ApiKeyError(ValueError):
    """A request the user can fix (shown to them as is)."""


def api_key_create(*, user, name: str) -> tuple[ApiKey, str]:
    """A new key for ``user``; returns the row and the plaintext, which is never stored."""
    name = name.strip()
    if not name:
        raise ApiKeyError("Give the key a name (what will use it?).")
    if len(name) > 100:
        raise ApiKeyError("Key names are limited to 100 characters.")
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(
        user=user, name=name, prefix=plaintext[:PREFIX_CHARS], key_sha256=secret_sha256(plaintext)
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
    digest = secret_sha256(plaintext)
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
