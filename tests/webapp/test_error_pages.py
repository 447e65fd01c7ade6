"""403, 404 and 500 render the product's layout (templates/40x.html, 500.html), not Django's
bare pages. DEBUG is off in tests, so Django's own handlers pick these templates."""

from __future__ import annotations

import pytest
from django.urls import include, path, reverse

pytestmark = pytest.mark.django_db


def _crash(request):
    raise RuntimeError("boom")


# The product's URLs plus one that crashes, for the 500 test (@pytest.mark.urls).
urlpatterns = [path("crash/", _crash), path("", include("webapp.urls"))]


def test_non_staff_get_a_styled_403_on_the_dashboard(client, django_user_model) -> None:
    alice = django_user_model.objects.create_user(username="alice", password="pw-alice-123")
    client.force_login(alice)
    response = client.get(reverse("dashboard:index"))
    assert response.status_code == 403
    assert [t.name for t in response.templates][:2] == ["403.html", "base.html"]
    html = response.content.decode()
    assert 'class="topbar"' in html and "css/app.css" in html
    assert "This page is for staff." in html
    assert ">alice<" in html  # the nav knows who is logged in


def test_unknown_address_gets_a_styled_404(client, django_user_model) -> None:
    client.force_login(django_user_model.objects.create_user(username="bob", password="x"))
    response = client.get("/no/such/page/")
    assert response.status_code == 404
    html = response.content.decode()
    assert 'id="error-404"' in html and 'class="topbar"' in html
    assert "<title>Not found · Ragblend</title>" in html


def test_someone_elses_document_is_a_styled_404(client, django_user_model) -> None:
    client.force_login(django_user_model.objects.create_user(username="carol", password="x"))
    response = client.get(reverse("documents:detail", args=[987654]))
    assert response.status_code == 404
    assert 'id="error-404"' in response.content.decode()


@pytest.mark.urls(__name__)
def test_a_crash_gets_a_styled_500(client) -> None:
    client.raise_request_exception = False
    response = client.get("/crash/")
    assert response.status_code == 500
    html = response.content.decode()
    assert 'id="error-500"' in html and 'class="topbar"' in html
    assert "boom" not in html  # nothing of the error is disclosed
