"""The site's icon: named by every page, served as a static file, and at the path clients
ask for by convention (a 404 in every log before)."""

from __future__ import annotations

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db


def test_the_favicon_is_served(client, alice) -> None:
    client.force_login(alice)
    page = client.get(reverse("documents:list")).content.decode()
    assert '<link rel="icon" href="/static/favicon.svg"' in page
    icon = client.get("/static/favicon.svg")
    assert icon.status_code == 200 and b"<svg" in b"".join(icon.streaming_content)
    legacy = client.get("/favicon.ico")
    assert legacy.status_code == 301 and legacy["Location"] == "/static/favicon.svg"
