"""Production settings: what `manage.py check --deploy` says, and keys that are refused."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

STRONG_KEY = "k3Y-" + "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"


def _manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DEBUG": "false", "HTTPS": "true", **env},
        timeout=120,
    )


def test_the_production_defaults_pass_djangos_deploy_check() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SECURE_COOKIES"}  # the defaults
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "DEBUG": "false", "HTTPS": "true", "SECRET_KEY": STRONG_KEY},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_a_weak_secret_key_is_refused_outside_debug() -> None:
    for weak in ("changeme", "django-insecure-" + "x" * 50, "ab" * 30):
        result = _manage("check", SECRET_KEY=weak)
        assert result.returncode != 0 and "SECRET_KEY is too weak" in result.stderr, weak
    assert _manage("check", SECRET_KEY="changeme", DEBUG="true").returncode == 0  # dev


def test_a_rate_limit_that_is_not_a_count_per_period_is_refused() -> None:
    for bad in ("lots", "20", "0/m", "20/week"):
        result = _manage("check", SECRET_KEY=STRONG_KEY, LOGIN_RATE_LIMIT=bad)
        assert result.returncode != 0, bad
        assert "LOGIN_RATE_LIMIT must be a count per period" in result.stderr, bad
    assert _manage("check", SECRET_KEY=STRONG_KEY, SIGNUP_RATE_LIMIT="5/2h").returncode == 0


def test_a_health_timeout_within_the_celery_ping_is_refused() -> None:
    """/healthz's deadline must leave the Celery ping, which waits its whole timeout, time
    to answer, or the Celery worker would always read as down."""
    result = _manage(
        "check", SECRET_KEY=STRONG_KEY, HEALTH_PING_TIMEOUT_S="3", HEALTH_TIMEOUT_S="2"
    )
    assert result.returncode != 0 and "HEALTH_TIMEOUT_S (2) must be longer" in result.stderr
    assert _manage("check", SECRET_KEY=STRONG_KEY, HEALTH_TIMEOUT_S="4").returncode == 0
