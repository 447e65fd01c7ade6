"""Target mode reads a ratio curve only where it was measured on the model that runs: the
curve's ``env.model_fingerprint`` against the worker's heartbeat. On another model no curve
steers the request and the dashboard says so, with the bench run that measures one."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from django.urls import reverse

from kvservice.protocol.codecs import DEFAULT_CODEC
from kvservice.protocol.heartbeat import heartbeat_key, write_heartbeat
from tests.webapp.dashboard.test_target import CURVE, _asked
from webapp.dashboard import selectors
from webapp.redis import redis_client

pytestmark = pytest.mark.django_db

NO_CURVE = "No ratio curve has been measured for this model"


@pytest.fixture
def curve_of_model_a(settings, tmp_path):
    path = tmp_path / "ratio_curve.json"
    env = {"kv_codec": DEFAULT_CODEC, "model_fingerprint": "model-a"}
    path.write_text(json.dumps({"modes": {}, "curve": CURVE, "env": env}))
    settings.RATIO_CURVE_PATH = path
    return path


@pytest.fixture
def running_model() -> Iterator[Callable[[str], None]]:
    """Write the worker's heartbeat naming the model (fingerprint) that runs."""

    def write(fingerprint: str) -> None:
        beat = {"model": "Some-Model", "model_loaded": True, "model_fingerprint": fingerprint}
        write_heartbeat(redis_client(), **beat)

    yield write
    redis_client().delete(heartbeat_key())


def test_a_curve_of_another_model_steers_no_request_and_the_dashboard_says_so(
    alice, staff_client, curve_of_model_a, running_model
) -> None:
    running_model("model-b")
    target = {"mode": "target", "fidelity_target": "0.04"}
    response = staff_client.post(reverse("dashboard:controller"), target, follow=True)
    assert NO_CURVE in response.content.decode()
    assert selectors.fidelity_target() == pytest.approx(0.04)
    assert selectors.target_ratio() is None  # today: 0.10, from model-a's curve
    index = staff_client.get(reverse("dashboard:index")).content.decode()
    assert NO_CURVE in index
    note = index[index.find(NO_CURVE) :].split("</p>", 1)[0]
    assert "Measure one with:" in note and "python -m kvservice.bench" in note
    sent = _asked(alice, "Which moon hides an ocean?")
    assert sent["target_ratio"] is None and sent["recompute_ratio"] is None


def test_the_curve_of_the_running_model_gives_the_targets_ratio(
    alice, staff_client, curve_of_model_a, running_model
) -> None:
    running_model("model-a")
    target = {"mode": "target", "fidelity_target": "0.04"}
    response = staff_client.post(reverse("dashboard:controller"), target, follow=True)
    assert "at least 0.100" in response.content.decode()
    index = staff_client.get(reverse("dashboard:index")).content.decode()
    assert NO_CURVE not in index and "reaches it from a ratio of 0.100" in index
    assert 'name="fixed_ratio" min="0" max="1" step="0.01" value="0.15"' in index  # the default
    sent = _asked(alice, "Which moon hides an ocean?")
    assert sent["target_ratio"] == pytest.approx(0.10)
