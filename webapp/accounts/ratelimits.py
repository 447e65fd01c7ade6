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
``API_RATE_LIMIT_WINDOW_S``. This one needs the cache: with it down the request fails (503)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import wraps

from axes.helpers import get_client_ip_address, get_cool_off
from django.conf import settings
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
            request, group=limit, key=client_address, rate=getattr(settings, setting),
            method="POST", increment=True,
        )  # fmt: skip
    except outages.SERVICE_ERRORS as err:
        log.warning("the %s rate limit is not counted, the cache is down: %s", limit, err)
        return None
    return _retry_after(usage)


def user_seconds_until_allowed(request: HttpRequest, user) -> int | None:
    """Count this request against ``user``'s limit; None while under it, else the seconds
    until its period ends."""
    rate = f"{settings.API_RATE_LIMIT_REQUESTS}/{settings.API_RATE_LIMIT_WINDOW_S}s"
    usage = get_usage(
        request, group="user", key=lambda _group, _request: str(user.pk), rate=rate,
        increment=True,
    )  # fmt: skip
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
