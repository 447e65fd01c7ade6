"""End to end through the real Celery worker, the real inference worker and the bundled
model: the ratio fixed on the dashboard is the ratio the worker uses for the next answer,
and a sampled blend answer is audited in full prefill and scored."""

from __future__ import annotations

import time

import pytest
from django.test import TestCase
from django.urls import reverse

from kvservice.protocol.heartbeat import read_heartbeat
from tests.conftest import wait_for
from tests.e2e.test_chat_e2e import collect_stream, upload_ready
from webapp.chat import services as chat
from webapp.chat.models import Message
from webapp.dashboard.models import FidelityAudit
from webapp.redis import redis_client
from webapp.units import kib

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# One file per question: an answer over the passages the answer before it read is served
# whole from the worker's prefix cache, and runs no ratio (it records none).
FILES = {
    "founding.txt": (
        "The Brennish observatory sits on Mount Talvar. It was founded in 1902 by the "
        "astronomer Ilse Marrow."
    ),
    "visitors.txt": (
        "Every August the Brennish observatory opens to visitors, who come to watch the "
        "Perseid meteor shower."
    ),
    "telescope.txt": "The main telescope of the Brennish observatory has a mirror of two metres.",
}
TEXT = " ".join(FILES.values())


def upload_observatory(user) -> None:
    for name, text in FILES.items():
        upload_ready(user, text, name)


def _ask(user, conversation, question: str) -> Message:
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = chat.chat_ask(user=user, conversation=conversation, question=question)
    _tokens, kind, payload = collect_stream(str(answer.request_id))
    assert kind == "done", payload

    def recorded() -> bool:
        answer.refresh_from_db()
        return answer.status == Message.Status.DONE

    wait_for(recorded, timeout=60, what="the answer to be recorded")
    return answer


def test_fixed_ratio_on_the_dashboard_is_used_by_the_worker_for_the_next_answer(
    celery_worker_process, inference_worker_process, django_user_model, client
) -> None:
    staff = django_user_model.objects.create_user(
        username="operator", password="operator-pass", is_staff=True
    )
    upload_observatory(staff)
    conversation = chat.conversation_create(owner=staff)
    client.force_login(staff)

    response = client.post(reverse("dashboard:controller"), {"mode": "fixed", "fixed_ratio": "0.4"})
    assert response.status_code == 302
    answer = _ask(staff, conversation, "Who founded the Brennish observatory?")
    assert answer.mode == "blend"
    assert answer.recompute_ratio == pytest.approx(0.4)

    client.post(reverse("dashboard:controller"), {"mode": "fixed", "fixed_ratio": "0.8"})
    answer = _ask(staff, conversation, "When does the observatory open to visitors?")
    assert answer.recompute_ratio == pytest.approx(0.8)

    # Back to auto: the worker's controller decides again (r_min or more, never the old value).
    client.post(reverse("dashboard:controller"), {"mode": "auto"})
    answer = _ask(staff, conversation, "How large is the telescope's mirror?")
    assert answer.recompute_ratio is not None and answer.recompute_ratio != pytest.approx(0.8)

    # The dashboard shows the worker's live tiers and its controller's last (auto) decision,
    # once the next heartbeat carries it (one written before may hold an earlier test's).
    answered = time.time()

    def live_panel_with_decision() -> str | None:
        beat = read_heartbeat(redis_client())
        if beat is None or beat["ts"] <= answered:
            return None
        page = client.get(reverse("dashboard:index"), HTTP_HX_REQUEST="true").content.decode()
        return page if 'id="last-ratio"' in page else None

    page = wait_for(live_panel_with_decision, timeout=20, interval=1, what="the last decision")
    assert "inference worker up" in page and 'id="tier-' in page
    assert f"recompute ratio {answer.recompute_ratio:.3f}" in page
    # the worker reports its model's shape: the page's KV a token at 16 bits is that model's
    shape = read_heartbeat(redis_client())["model_shape"]
    fp16 = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2
    full = client.get(reverse("dashboard:index")).content.decode()
    assert f"In 16 bits a token takes {kib(fp16)}" in full


QUESTIONS_TO_UPGRADE = [
    "Who founded the Brennish observatory?",
    "Describe the Brennish observatory and its history.",
    "What does the Brennish observatory study, and who founded it?",
]


def test_progressive_blend_set_on_the_dashboard_upgrades_the_workers_next_answer(
    celery_worker_process, inference_worker_process, django_user_model, client
) -> None:
    """Progressive blend set on the dashboard reaches the real worker: the answer records the
    ratio its cache was upgraded to and its second token, after its first; set to 0, the
    next answer is not upgraded."""
    staff = django_user_model.objects.create_user(
        username="operator", password="operator-pass", is_staff=True
    )
    upload_observatory(staff)
    conversation = chat.conversation_create(owner=staff)
    client.force_login(staff)
    progressive = {"mode": "fixed", "fixed_ratio": "0.1", "refresh_ratio": "0.5"}
    assert client.post(reverse("dashboard:controller"), progressive).status_code == 302
    # An answer that ends before its upgrade lands is not upgraded (the worker drops it): on a
    # loaded machine a short answer can, so up to three questions are asked.
    for question in QUESTIONS_TO_UPGRADE:
        answer = _ask(staff, conversation, question)
        assert answer.recompute_ratio == pytest.approx(0.1)
        if answer.refresh_ratio is not None:
            break
    assert answer.refresh_ratio == pytest.approx(0.5) and answer.completion_tokens > 1
    assert answer.second_token_s > answer.ttft_s > 0

    client.post(reverse("dashboard:controller"), dict(progressive, refresh_ratio="0"))
    answer = _ask(staff, conversation, "When does the observatory open to visitors?")
    assert answer.refresh_ratio is None and answer.second_token_s > answer.ttft_s


def test_a_sampled_blend_answer_is_audited_in_full_prefill(
    celery_worker_process, inference_worker_process, django_user_model, client
) -> None:
    staff = django_user_model.objects.create_user(
        username="auditor", password="auditor-pass", is_staff=True
    )
    upload_ready(staff, TEXT.replace("Brennish", "Quorran"), "quorran.txt")
    client.force_login(staff)
    client.post(reverse("dashboard:audit"), {"sample_rate": "1"})
    conversation = chat.conversation_create(owner=staff)
    answer = _ask(staff, conversation, "Who founded the Quorran observatory?")

    def audited() -> FidelityAudit | None:
        audit = FidelityAudit.objects.filter(message=answer).first()
        return audit if audit and audit.status != FidelityAudit.Status.PENDING else None

    audit = wait_for(audited, timeout=120, what="the fidelity audit to be recorded")
    assert audit.status == "done", audit.error_message
    assert audit.blend_text == answer.content and audit.full_text.strip()
    assert 0.0 <= audit.token_f1 <= 1.0
    assert Message.objects.filter(conversation=conversation).count() == 2  # no extra message
