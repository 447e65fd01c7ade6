"""Who a client is, by address: what the login throttles (django-axes, the per-address rate
limits) count against.

Behind a reverse proxy (the Kubernetes ingress) every request comes from the proxy's address,
so every user would share one login budget. With ``TRUSTED_PROXY_COUNT`` proxies in front,
each appending the address it was reached from to ``X-Forwarded-For``, the client is the
entry that many places from the right: what the outermost trusted proxy saw. Entries further
left are the client's own words and never trusted."""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def client_ip(request: HttpRequest) -> str | None:
    """The client's address: ``REMOTE_ADDR``, or the trusted ``X-Forwarded-For`` entry behind
    ``TRUSTED_PROXY_COUNT`` proxies; None when neither holds an address."""
    count = settings.TRUSTED_PROXY_COUNT
    if count:
        header = request.META.get("HTTP_X_FORWARDED_FOR", "")
        forwarded = [entry.strip() for entry in header.split(",") if entry.strip()]
        if len(forwarded) >= count and _is_address(forwarded[-count]):
            return forwarded[-count]
    remote = request.META.get("REMOTE_ADDR", "")
    return remote if _is_address(remote) else None


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
