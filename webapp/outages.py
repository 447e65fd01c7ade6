"""When a service the web app needs is down (Redis/valkey, the broker, S3, PostgreSQL).

A request that needs it gets a 503 with ``Retry-After`` and a plain message, never a 500 (and
never Django's debug page, which would show the service URLs). The API renders the same
errors in its own JSON shape (``webapp.api.errors.normalize``).

``ReporterFilter`` hides the settings that carry credentials inside a URL (``REDIS_URL``,
``CELERY_BROKER_URL``…) from error reports and the debug page; Django's own filter hides only
names like ``*PASSWORD*``, ``*SECRET*``, ``*KEY*``.
"""

from __future__ import annotations

import logging
import re

import kombu.exceptions
import redis
import urllib3.exceptions
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.views.debug import SafeExceptionReporterFilter

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 10
MESSAGE = "A service Ragblend needs is not responding. Nothing was lost; try again in a moment."

# What a dead or unreachable service raises: Redis/valkey (streams, stop flags, the API's
# rate limit), the Celery broker (kombu), S3 (urllib3 under minio), PostgreSQL.
SERVICE_ERRORS: tuple[type[BaseException], ...] = (
    redis.RedisError,
    kombu.exceptions.OperationalError,
    urllib3.exceptions.HTTPError,
    OperationalError,
    InterfaceError,
)


def is_outage(exc: BaseException) -> bool:
    """A dead service, not a bug (a bad query is a ``ProgrammingError``, and stays a 500);
    the documents' ``TransientError`` (storage unreachable) is one too."""
    from webapp.documents.services import TransientError

    return isinstance(exc, (*SERVICE_ERRORS, TransientError))


def unavailable_response(request: HttpRequest) -> HttpResponse:
    if getattr(request, "htmx", False):
        body = render_to_string("chat/_error.html", {"error": MESSAGE}, request=request)
    else:
        context = {"message": MESSAGE, "retry_after": RETRY_AFTER_S}
        body = render_to_string("503.html", context)
    response = HttpResponse(body, status=503)
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


class ServiceUnavailableMiddleware:
    """A view that fails because a service is down answers 503, not 500."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if not is_outage(exc):
            return None
        logger.warning("%s %s: service unavailable: %r", request.method, request.path, exc)
        return unavailable_response(request)


class ReporterFilter(SafeExceptionReporterFilter):
    """Django's filter, plus every setting that may hold a URL with a password in it."""

    hidden_settings = re.compile(
        r"API|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|URL|BROKER|BACKEND|ENDPOINT|DATABASE"
        r"|LOCATION",  # CACHES' LOCATION is REDIS_URL
        flags=re.IGNORECASE,
    )
