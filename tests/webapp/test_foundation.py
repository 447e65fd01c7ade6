"""The foundation against real services: database with pgvector, S3, broker, Celery, pages."""

from __future__ import annotations

import io
import uuid

import pytest
from django.conf import settings
from django.db import connection

from webapp.health import run_checks
from webapp.storage import object_store

pytestmark = pytest.mark.django_db


def test_pgvector_nearest_neighbour_query_orders_by_distance() -> None:
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE probe (id int, embedding vector(3))")
        cursor.execute(
            "INSERT INTO probe VALUES (1, '[1,0,0]'), (2, '[0,1,0]'), (3, '[0.9,0.1,0]')"
        )
        cursor.execute("SELECT id FROM probe ORDER BY embedding <=> '[1,0.05,0]'::vector LIMIT 2")
        assert [row[0] for row in cursor.fetchall()] == [1, 3]


def test_s3_put_then_get_returns_the_same_bytes() -> None:
    client = object_store()
    key = f"probe/{uuid.uuid4()}"
    payload = uuid.uuid4().bytes * 1000
    client.put_object(settings.S3_DOCUMENTS_BUCKET, key, io.BytesIO(payload), len(payload))
    try:
        response = client.get_object(settings.S3_DOCUMENTS_BUCKET, key)
        assert response.read() == payload
        ranged = client.get_object(settings.S3_DOCUMENTS_BUCKET, key, offset=16, length=32)
        assert ranged.read() == payload[16:48]
    finally:
        client.remove_object(settings.S3_DOCUMENTS_BUCKET, key)


def test_healthz_reports_each_component_and_is_503_without_workers(client) -> None:
    response = client.get("/healthz")
    body = response.json()
    assert set(body["components"]) == {
        "database",
        "pgvector",
        "object_store",
        "broker",
        "web_models",
        "celery_worker",
        "inference_worker",
        "model",
    }
    for name in ("database", "pgvector", "object_store", "broker"):
        assert body["components"][name]["status"] == "up", body["components"][name]
    # No inference worker runs in this test: the check must say so, and the status must be 503.
    assert body["components"]["inference_worker"]["status"] == "down"
    assert response.status_code == 503
    assert body["status"] == "degraded"


def test_readyz_and_livez_are_200_without_workers(client) -> None:
    """The web server is ready when its database and Redis answer: pages and uploads work
    without the workers, so a probe must not take it out of service for them."""
    assert client.get("/livez").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ok"}


def test_ensure_buckets_creates_the_missing_bucket_and_keeps_the_rest(settings) -> None:
    from django.core.management import call_command

    settings.S3_KV_BUCKET = f"kv-ensure-{uuid.uuid4().hex[:8]}"
    out = io.StringIO()
    call_command("ensure_buckets", stdout=out)
    try:
        assert object_store().bucket_exists(settings.S3_KV_BUCKET)
        assert f"Created bucket {settings.S3_KV_BUCKET!r}" in out.getvalue()
        assert f"{settings.S3_DOCUMENTS_BUCKET!r} exists already" in out.getvalue()
    finally:
        object_store().remove_bucket(settings.S3_KV_BUCKET)


def test_healthz_details_are_for_staff_only(client, django_user_model, settings) -> None:
    anonymous = client.get("/healthz")
    assert all(set(c) == {"status"} for c in anonymous.json()["components"].values())
    assert settings.S3_ENDPOINT not in anonymous.content.decode()
    staff = django_user_model.objects.create_user("stella", password="pw-stella-1", is_staff=True)
    client.force_login(staff)
    body = client.get("/healthz").json()
    assert body["components"]["object_store"]["endpoint"] == settings.S3_ENDPOINT
    assert "error" in body["components"]["inference_worker"]  # none runs in this test


def test_object_store_check_fails_when_a_bucket_is_missing(settings) -> None:
    settings.S3_KV_BUCKET = "no-such-bucket"
    result = run_checks()["object_store"]
    assert result["status"] == "down"
    assert "no-such-bucket" in result["error"]


def test_login_page_renders_and_home_requires_login(client, django_user_model) -> None:
    assert client.get("/chat/").status_code == 302  # to the login page
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    assert b"htmx-2.0.11.min.js" in page.content
    django_user_model.objects.create_user(username="ada", password="a-long-passphrase")
    response = client.post("/accounts/login/", {"username": "ada", "password": "a-long-passphrase"})
    assert response.status_code == 302
    page = client.get("/", follow=True)
    assert page.redirect_chain[-1][0] == "/chat/"
    assert b"ada" in page.content and b"Ask your documents" in page.content


def test_wrong_password_is_refused(client, django_user_model) -> None:
    django_user_model.objects.create_user(username="bob", password="a-long-passphrase")
    response = client.post("/accounts/login/", {"username": "bob", "password": "nope"})
    assert response.status_code == 200
    assert b"didn&#x27;t match" in response.content or b"didn't match" in response.content
    assert client.get("/chat/").status_code == 302


def test_repeated_wrong_passwords_lock_the_login_out(client, django_user_model, settings) -> None:
    """After ``AXES_FAILURE_LIMIT`` wrong passwords for one username from one address, even
    the right password is refused (429) until the cool-off; other users are not affected."""
    django_user_model.objects.create_user(username="bob", password="a-long-passphrase")
    django_user_model.objects.create_user(username="eve", password="eve-passphrase-1")
    for _ in range(settings.AXES_FAILURE_LIMIT):
        client.post("/accounts/login/", {"username": "bob", "password": "guess"})
    locked = client.post("/accounts/login/", {"username": "bob", "password": "a-long-passphrase"})
    assert locked.status_code == 429 and b"Too many attempts" in locked.content
    assert client.get("/chat/").status_code == 302  # not logged in
    other = client.post("/accounts/login/", {"username": "eve", "password": "eve-passphrase-1"})
    assert other.status_code == 302 and client.get("/chat/").status_code == 200
