"""Rate limits, counted by django-ratelimit in Django's cache (valkey, which every web
process shares).

Sign-up and login attempts per client address: past ``SIGNUP_RATE_LIMIT`` or
``LOGIN_RATE_LIMIT`` POSTs from one address (a count per period, "20/m"), a styled 429 with
Retry-After until the period ends.

This bounds one address across every username (guessing many accounts' passwords, making
many accounts); django-axes still locks one username at one address after a few wrong
passwords (its 429, ``axes_lockout_response``, has a Retry-After too). The address is the
one django-axes sees (``addresses.client_ip``, behind a proxy too), so both agree on who a
client is.

Requests per user (``user_seconds_until_allowed``): every API key of a user, the session's API
calls and the questions asked in the browser share ``API_RATE_LIMIT_REQUESTS`` per
``API_RATE_LIMIT_WINDOW_S``. This one needs the cache: with it down the request fails (503).

Wrong passwords per account, from any addresses (``lock_accounts``): the per-address limits
never see a guesser who spreads one account's guesses over many addresses. The
``LOGIN_ACCOUNT_FAILURE_LIMIT``-th wrong password for a username within
``LOGIN_ACCOUNT_LOCKOUT`` pauses its password logins for ``LOGIN_ACCOUNT_LOCKOUT``: a 429 with
Retry-After, the same page whether the password was right and whether an account has that
username (unknown usernames are counted too). The pause ends by itself; staff lift it on the
Users page, and changing the password lifts it. Sessions and API keys are not touched, so a
guesser can keep someone from logging in anew for a while, never out of what they have open."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from functools import wraps

from axes.handlers.proxy import AxesProxyHandler
from axes.helpers import get_client_ip_address, get_cool_off
from django.conf import settings
from django.contrib.auth.forms import UsernameField
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django_ratelimit.core import get_usage

from webapp import outages

log = logging.getLogger(__name__)

# Each limit: the setting holding its rate, and what its attempts are called on the 429 page.
LIMITS = {
    "login": ("LOGIN_RATE_LIMIT", "login attempts"),
    "signup": ("SIGNUP_RATE_LIMIT", "sign-up attempts"),
}


def client_address(group: str, request: HttpRequest) -> str:
    return get_client_ip_address(request) or "unknown"


def _seconds_until_allowed(request: HttpRequest, limit: str) -> int | None:
    """Count this POST against ``limit``; None while under it, else the seconds until its
    period ends. With the cache down the POST is let through (and logged): axes still locks
    a guessed username, and nobody is locked out of logging in by an outage."""
    setting, _ = LIMITS[limit]
    try:
        usage = get_usage(
            request,
            group=limit,
            key=client_address,
            rate=getattr(settings, setting),
            method="POST",
            increment=True,
        )
    except outages.SERVICE_ERRORS as err:
        log.warning("the %s rate limit is not counted, the cache is down: %s", limit, err)
        return None
    return _retry_after(usage)


def user_seconds_until_allowed(request: HttpRequest, user) -> int | None:
    """Count this request against ``user``'s limit; None while under it, else the seconds
    until its period ends."""
    rate = f"{settings.API_RATE_LIMIT_REQUESTS}/{settings.API_RATE_LIMIT_WINDOW_S}s"
    usage = get_usage(
        request,
        group="user",
        key=lambda _group, _request: str(user.pk),
        rate=rate,
        increment=True,
    )
    return _retry_after(usage)


def _retry_after(usage: dict | None) -> int | None:
    """None while under the limit, else the seconds until its period ends."""
    if usage is None or not usage["should_limit"]:
        return None
    return max(1, usage["time_left"])


def _wait_words(seconds: int) -> str:
    if seconds < 90:
        return f"{seconds} seconds"
    return f"{round(seconds / 60)} minutes"


def too_many_attempts(request: HttpRequest, limit: str, retry_after: int) -> HttpResponse:
    _, attempts = LIMITS[limit]
    context = {"attempts": attempts, "wait": _wait_words(retry_after)}
    response = render(request, "accounts/rate_limited.html", context, status=429)
    response["Retry-After"] = str(retry_after)
    return response


def limit_posts(limit: str) -> Callable:
    """A view decorator: POSTs to the view count against ``limit`` ("login" or "signup") per
    client address, and past it get the 429 page instead of the view."""
    if limit not in LIMITS:
        raise ValueError(f"Unknown rate limit {limit!r}: one of {sorted(LIMITS)}.")

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def limited(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method == "POST":
                retry_after = _seconds_until_allowed(request, limit)
                if retry_after is not None:
                    return too_many_attempts(request, limit, retry_after)
            return view(request, *args, **kwargs)

        return limited

    return decorator


# --- per account ---------------------------------------------------------------------------


def _account_key(username: str, part: str) -> str:
    """The cache key of ``username``'s "failures" or "locked-until": a digest, so whatever
    text a client posts makes a short key of one shape."""
    return f"login-account:{hashlib.sha256(username.encode()).hexdigest()}:{part}"


def _login_username(request: HttpRequest) -> str:
    """The username a login POST names, as the login form reads it (stripped, NFKC): every
    spelling that reaches one account counts against it."""
    return UsernameField().to_python(request.POST.get("username", ""))


def _lockout_seconds() -> int:
    return math.ceil(settings.LOGIN_ACCOUNT_LOCKOUT.total_seconds())


def account_locks(usernames: Iterable[str]) -> dict[str, float]:
    """When the locked ones of ``usernames`` unlock (a Unix time); the others are left out."""
    keys = {_account_key(username, "locked-until"): username for username in usernames}
    return {keys[key]: until for key, until in cache.get_many(list(keys)).items()}


def _seconds_locked(username: str) -> int | None:
    """None while ``username`` is not locked, else the seconds until it unlocks."""
    until = cache.get(_account_key(username, "locked-until"))
    return None if until is None else max(1, math.ceil(until - time.time()))


def _count_failure(username: str) -> int | None:
    """Count a wrong password for ``username``; None while under the limit, else (this one
    locked it) the seconds it is locked for. The window opens at the first failure and lasts
    as long as a lock, so a lock outlives the failures that made it."""
    seconds = _lockout_seconds()
    failures_key = _account_key(username, "failures")
    cache.add(failures_key, 0, timeout=seconds)
    try:
        failures = cache.incr(failures_key)
    except ValueError:  # the window closed between the two calls: this one opens the next
        failures = 1
        cache.set(failures_key, failures, timeout=seconds)
    if failures < settings.LOGIN_ACCOUNT_FAILURE_LIMIT:
        return None
    cache.set(_account_key(username, "locked-until"), time.time() + seconds, timeout=seconds)
    cache.delete(failures_key)
    return seconds


def account_unlock(username: str) -> None:
    """Lift ``username``'s lock and forget its failures."""
    cache.delete_many([_account_key(username, part) for part in ("locked-until", "failures")])


def account_locked(request: HttpRequest, retry_after: int) -> HttpResponse:
    """The lock's page: nothing on it depends on the username or the password posted."""
    context = {"wait": _wait_words(retry_after)}
    response = render(request, "accounts/account_locked.html", context, status=429)
    response["Retry-After"] = str(retry_after)
    return response


def _failed_login(request: HttpRequest, response: HttpResponse) -> bool:
    """Whether a login POST that reached the password check was refused: the form came back
    (200, a 429 is a lockout's) and nobody is logged in."""
    return (
        bool(request.POST.get("password"))
        and response.status_code == 200
        and not request.user.is_authenticated
    )


def lock_accounts(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A login view decorator: a POST naming a locked username gets the lock page, its
    password unchecked; a wrong password counts against the username, and the one that
    reaches the limit gets the lock page already. An attempt django-axes refuses (its
    per-address lockout, which checks no password) is not counted: one address alone meets
    that lockout first, and never locks the account for every other address. With the cache
    down the POST is let through (and logged), as the per-address limits do."""

    @wraps(view)
    def locking(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        username = _login_username(request) if request.method == "POST" else ""
        if not username:
            return view(request, *args, **kwargs)
        try:
            retry_after = _seconds_locked(username)
        except outages.SERVICE_ERRORS as err:
            log.warning("the login account lock is not checked, the cache is down: %s", err)
            return view(request, *args, **kwargs)
        if retry_after is not None:
            return account_locked(request, retry_after)
        checks_password = AxesProxyHandler.is_allowed(request, {"username": username})
        response = view(request, *args, **kwargs)
        if checks_password and _failed_login(request, response):
            try:
                retry_after = _count_failure(username)
            except outages.SERVICE_ERRORS as err:
                log.warning("a wrong password is not counted, the cache is down: %s", err)
                return response
            if retry_after is not None:  # this wrong password locked the account
                return account_locked(request, retry_after)
        return response

    return locking


def axes_lockout_response(
    request: HttpRequest, original_response: HttpResponse | None = None, credentials=None
) -> HttpResponse:
    """django-axes' lockout page (AXES_LOCKOUT_CALLABLE): a 429 with Retry-After, as the rate
    limits' own. Each refused attempt starts the cool-off again (axes'
    AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT, on by default), and this page answers one,
    so the wait is the whole cool-off."""
    retry_after = max(1, math.ceil(get_cool_off(request).total_seconds()))
    context = {"wait": _wait_words(retry_after)}
    response = render(request, settings.AXES_LOCKOUT_TEMPLATE, context, status=429)
    response["Retry-After"] = str(retry_after)
    return response
