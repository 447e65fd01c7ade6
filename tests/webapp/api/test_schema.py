"""Schemathesis against the generated OpenAPI schema, in-process (the WSGI app): no 5xx, and
every response matches the schema (status codes, content types, bodies, headers)."""

from __future__ import annotations

import itertools
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.webapp.api.conftest import bearer
from tests.webapp.api.fake_worker import FakeInferenceWorker
from webapp.redis import redis_client

MAX_EXAMPLES = 10
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def api_schema(transactional_db, settings):  # noqa: F811 - pytest-django's settings fixture
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    from webapp.wsgi import application

    # Questions are answered by the stand-in worker (sent on commit, hence transactional_db):
    # a 5xx is a failure, and the worker exists, so a 504 would be one.
    settings.API_ANSWER_TIMEOUT_S = 10
    settings.API_RATE_LIMIT_REQUESTS = 100_000
    # As Django's test client does: keep the test's connection (and its transaction) open.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield schemathesis.openapi.from_wsgi("/api/v1/openapi.json", application)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def auth_headers(django_user_model) -> dict[str, str]:
    user = django_user_model.objects.create_user(username="fuzz", password="pw", is_staff=True)
    return {"Authorization": bearer(user)["HTTP_AUTHORIZATION"]}


def test_api_conforms_to_its_schema(api_schema, auth_headers) -> None:
    with FakeInferenceWorker(redis_client()):
        _run_schemathesis(api_schema, auth_headers)


def _run_schemathesis(api_schema, auth_headers) -> None:
    # Hypothesis directly over each operation's strategy (schemathesis' pytest plugin does not
    # run under this pytest version); bounded so the whole run takes well under a minute.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation, mode in itertools.product(operations, GenerationMode):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def conforms(case) -> None:
            case.call_and_validate(headers=auth_headers, checks=CHECKS)

        try:
            conforms()
        except Exception as err:
            raise AssertionError(f"{operation.label} ({mode} data): {err}") from err


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicated keys: {keys}"  # Swagger UI refuses them
    return dict(pairs)


def test_schema_and_docs_are_served(client) -> None:
    response = client.get("/api/v1/openapi.json")
    schema = json.loads(response.content, object_pairs_hook=_no_duplicate_keys)
    streamed = schema["paths"]["/api/v1/query"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}
    assert {"/api/v1/documents", "/api/v1/query", "/api/v1/conversations"} <= set(schema["paths"])
    docs = client.get("/api/v1/docs")
    assert docs.status_code == 200 and b"swagger-ui" in docs.content
    assert b"cdn." not in docs.content  # vendored static files, never a CDN
