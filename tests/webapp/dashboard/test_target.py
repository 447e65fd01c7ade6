"""A fidelity target set on the dashboard: stored, turned into a ratio by the measured curve,
sent with the next chat request as its least ratio, shown in the live panel; the fidelity
audit shows what the curve predicted for each audited answer beside what was measured."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from django.conf import settings as django_settings
from django.test import TestCase
from django.urls import reverse

from kvservice.protocol import GENERATE_TASK, INFERENCE_QUEUE
from kvservice.protocol.codecs import DEFAULT_CODEC
from tests.webapp.chat.test_chat import PASSAGES, make_document
from tests.webapp.dashboard.factories import make_answers
from tests.webapp.dashboard.factories import make_document as make_dashboard_document
from webapp.chat import services as chat
from webapp.chat.models import Message
from webapp.dashboard import selectors
from webapp.dashboard.models import DashboardSettings, FidelityAudit

pytestmark = pytest.mark.django_db


def _point(label: str, ratio: float, kl: float, f1: float) -> dict:
    return {
        "label": label,
        "ratio": ratio,
        "ttft_median_s": 1.0,
        "ttft_ratio_to_full": ratio,
        "tf_kl_mean": kl,
        "tf_kl_median": kl,
        "tf_kl_ci95": [kl, kl],
        "tf_agreement": 1 - kl,
        "tf_logprob_gap_mean": kl,
        "fidelity_f1": f1,
    }


CURVE = [
    _point("reuse", 0.0, 0.09, 0.70),
    _point("blend@0.05", 0.05, 0.05, 0.80),
    _point("blend@0.15", 0.15, 0.03, 0.90),
    _point("full", 1.0, 0.0, 1.0),
]


@pytest.fixture
def curve(settings, tmp_path):
    path = tmp_path / "ratio_curve.json"
    path.write_text(json.dumps({"modes": {}, "curve": CURVE, "env": {"kv_codec": DEFAULT_CODEC}}))
    settings.RATIO_CURVE_PATH = path
    return path


def test_a_fidelity_target_is_stored_and_the_curve_gives_its_ratio(staff_client, curve) -> None:
    response = staff_client.post(
        reverse("dashboard:controller"), {"mode": "target", "fidelity_target": "0.04"}, follow=True
    )
    page = response.content.decode()
    assert "mean KL to full at most 0.04" in page and "at least 0.100" in page
    assert selectors.fidelity_target() == pytest.approx(0.04)
    assert selectors.target_ratio() == pytest.approx(0.10)  # halfway from 0.05 to 0.03
    assert selectors.fixed_recompute_ratio() is None
    assert str(DashboardSettings.objects.get()) == "fidelity target: mean KL to full <= 0.04"
    live = staff_client.get(reverse("dashboard:index"), HTTP_HX_REQUEST="true").content.decode()
    assert "fidelity target: mean KL to full ≤ 0.0400" in live

    staff_client.post(reverse("dashboard:controller"), {"mode": "auto"})
    assert selectors.fidelity_target() is None and selectors.target_ratio() is None


def test_the_target_reads_the_curve_of_the_codec_the_store_writes(
    staff_client, curve, monkeypatch
) -> None:
    fp16 = [
        _point("reuse", 0.0, 0.06, 0.75),
        _point("blend@0.05", 0.05, 0.02, 0.90),
        _point("full", 1.0, 0.0, 1.0),
    ]
    sibling = curve.with_name("ratio_curve_fp16.json")
    sibling.write_text(json.dumps({"modes": {}, "curve": fp16, "env": {"kv_codec": "fp16"}}))
    target = {"mode": "target", "fidelity_target": "0.04"}
    staff_client.post(reverse("dashboard:controller"), target)
    monkeypatch.setenv("KV_CODEC", DEFAULT_CODEC)
    assert selectors.target_ratio() == pytest.approx(0.10)  # CURVE: halfway from 0.05 to 0.03
    monkeypatch.setenv("KV_CODEC", "fp16")
    assert selectors.ratio_curve()["codec"] == "fp16"
    assert selectors.target_ratio() == pytest.approx(0.025)  # fp16's: halfway from 0.06 to 0.02
    monkeypatch.setenv("KV_CODEC", "int8")  # no curve measured with it
    assert selectors.target_ratio() is None
    response = staff_client.post(reverse("dashboard:controller"), target, follow=True)
    assert "no measured curve yet for the store&#x27;s codec (8-bit integers)" in (
        response.content.decode()
    )


@pytest.mark.parametrize("bad", ["-0.01", "abc", "", "inf"])
def test_a_bad_target_is_refused_with_a_message(staff_client, bad) -> None:
    response = staff_client.post(
        reverse("dashboard:controller"), {"mode": "target", "fidelity_target": bad}, follow=True
    )
    assert "fidelity target must be a mean KL" in response.content.decode()
    assert selectors.fidelity_target() is None


def test_without_a_curve_the_target_leaves_the_ratio_to_the_controller(staff_client) -> None:
    response = staff_client.post(
        reverse("dashboard:controller"), {"mode": "target", "fidelity_target": "0.04"}, follow=True
    )
    assert "no measured curve yet" in response.content.decode()
    assert selectors.fidelity_target() == pytest.approx(0.04) and selectors.target_ratio() is None


def _asked(alice, question: str) -> dict:
    """The GenerateRequest a chat question of ``alice``'s sends to the inference queue."""
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    client.delete(INFERENCE_QUEUE)
    try:
        make_document(alice, "space.md", [PASSAGES["space"]])
        conversation = chat.conversation_create(owner=alice)
        with TestCase.captureOnCommitCallbacks(execute=True):
            chat.chat_ask(user=alice, conversation=conversation, question=question)
        sent = []
        for raw in client.lrange(INFERENCE_QUEUE, 0, -1):
            message = json.loads(raw)
            if message["headers"]["task"] == GENERATE_TASK:
                sent.append(json.loads(base64.b64decode(message["body"]))[0][0])
    finally:
        client.delete(INFERENCE_QUEUE)
    assert len(sent) == 1
    return sent[0]


def test_the_next_chat_request_carries_the_targets_ratio(alice, staff_client, curve) -> None:
    staff_client.post(
        reverse("dashboard:controller"), {"mode": "target", "fidelity_target": "0.05"}
    )
    sent = _asked(alice, "Which moon hides an ocean?")
    assert sent["target_ratio"] == pytest.approx(0.05) and sent["recompute_ratio"] is None
    assert sent["refresh_ratio"] == 0.0  # plain blend reaches it: nothing upgrades


# Progressive blend upgrading to 0.25 on the same curve: from 0.05 KL 0.032, from 0.15 0.028.
PROGRESSIVE = [
    dict(
        _point("blend@0.05>0.25", 0.05, 0.032, 0.88),
        refresh_ratio=0.25,
        second_token_ratio_to_full=0.9,
    ),
    dict(
        _point("blend@0.15>0.25", 0.15, 0.028, 0.92),
        refresh_ratio=0.25,
        second_token_ratio_to_full=1.0,
    ),
]


def test_a_target_plain_blend_reaches_late_is_met_by_progressive_blend(
    alice, staff_client, curve
) -> None:
    """With progressive blend set to 0.25 on the dashboard, a target of 0.03 (plain blend
    reaches it at 0.15) starts from progressive blend's crossing, halfway from 0.05 (0.032)
    to 0.15 (0.028): 0.10, sent with its upgrade."""
    data = json.loads(curve.read_text())
    curve.write_text(json.dumps(dict(data, curve=[*CURVE, *PROGRESSIVE])))
    response = staff_client.post(
        reverse("dashboard:controller"),
        {"mode": "target", "fidelity_target": "0.03", "refresh_ratio": "0.25"},
        follow=True,
    )
    page = response.content.decode()
    assert "at least 0.100, upgraded to 0.25 after the first token" in page
    assert selectors.target_plan() == (pytest.approx(0.10), 0.25)
    sent = _asked(alice, "Which moon hides an ocean?")
    assert sent["target_ratio"] == pytest.approx(0.10) and sent["refresh_ratio"] == 0.25
    index = staff_client.get(reverse("dashboard:index")).content.decode()
    assert "upgraded to 0.25 after the first token (progressive blend)" in index
    live = staff_client.get(reverse("dashboard:index"), HTTP_HX_REQUEST="true").content.decode()
    assert "upgrade to 0.25 after the first token" in live

    # progressive blend off (0): plain blend's own ratio for the same target, sent as off
    off = {"mode": "target", "fidelity_target": "0.03", "refresh_ratio": "0"}
    staff_client.post(reverse("dashboard:controller"), off)
    assert selectors.target_plan() == (pytest.approx(0.15), None)
    # auto: the setting as it is; blank: the worker's own (None)
    staff_client.post(reverse("dashboard:controller"), {"mode": "auto", "refresh_ratio": "0.3"})
    assert selectors.request_ratios() == {
        "recompute_ratio": None,
        "target_ratio": None,
        "refresh_ratio": 0.3,
    }
    staff_client.post(reverse("dashboard:controller"), {"mode": "auto", "refresh_ratio": ""})
    assert selectors.request_ratios()["refresh_ratio"] is None


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "abc"])
def test_a_bad_progressive_ratio_is_refused_and_nothing_changes(staff_client, bad) -> None:
    staff_client.post(reverse("dashboard:controller"), {"mode": "auto", "refresh_ratio": "0.25"})
    fixed = {"mode": "fixed", "fixed_ratio": "0.2", "refresh_ratio": bad}
    response = staff_client.post(reverse("dashboard:controller"), fixed, follow=True)
    assert "The ratio progressive blend upgrades to must be" in response.content.decode()
    row = DashboardSettings.objects.get()
    assert row.refresh_ratio == 0.25 and row.controller_mode == "auto"


def test_the_audit_shows_the_curves_prediction_beside_the_measured_f1(
    staff_client, alice, curve
) -> None:
    document = make_dashboard_document(alice, "Rivers of Europe", chunks=2)
    answer = next(a for a in make_answers(alice, document) if a.mode == "blend")
    audit = FidelityAudit.objects.create(
        message=answer,
        blend_text="x",
        full_text="y",
        token_f1=0.62,
        status="done",
        blend_recompute_ratio=0.10,
        completed_at=answer.completed_at,
    )
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    row = page.split(f'id="audit-{audit.message_id}"')[1].split("</tr>")[0]
    assert '<td class="predicted-kl">0.0400</td>' in row  # halfway from 0.05 to 0.03
    assert '<td class="predicted-f1">0.850</td>' in row
    assert '<td class="measured-f1">0.620</td>' in row


def test_a_progressive_answers_audit_is_predicted_from_the_progressive_curve(
    staff_client, alice, curve
) -> None:
    data = json.loads(curve.read_text())
    curve.write_text(json.dumps(dict(data, curve=[*CURVE, *PROGRESSIVE])))
    document = make_dashboard_document(alice, "Rivers of Europe", chunks=2)
    answer = next(a for a in make_answers(alice, document) if a.mode == "blend")
    audit = FidelityAudit.objects.create(
        message=answer,
        blend_text="x",
        full_text="y",
        token_f1=0.7,
        status="done",
        blend_recompute_ratio=0.10,
        blend_refresh_ratio=0.25,
        completed_at=answer.completed_at,
    )
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    row = page.split(f'id="audit-{audit.message_id}"')[1].split("</tr>")[0]
    assert "0.100 → 0.25" in row
    assert '<td class="predicted-kl">0.0300</td>' in row  # halfway from 0.032 to 0.028
    assert '<td class="predicted-f1">0.900</td>' in row


def test_the_answers_table_counts_progressive_answers_and_their_second_token(
    staff_client, alice
) -> None:
    blends = [a for a in make_answers(alice) if a.mode == "blend"]
    for answer, second in zip(blends[:2], (0.9, 1.3), strict=True):
        Message.objects.filter(pk=answer.pk).update(refresh_ratio=0.25, second_token_s=second)
    Message.objects.filter(pk=blends[2].pk).update(second_token_s=0.2)  # not upgraded
    page = staff_client.get(reverse("dashboard:index")).content.decode()
    rows = {
        row.split("</th>")[0].rsplit(">", 1)[-1]: row
        for row in page.split('<tr><th scope="row">')[1:]
    }
    # two upgraded (the third's second token is not counted), median: the lower of the two
    assert '<td class="progressive">2 (900.0 ms)</td>' in rows["blend"]
    assert '<td class="progressive">—</td>' in rows["full"]
