"""Answers a user can trust, end to end over a small company handbook (tests/data/handbook:
five documents in four formats, 19 questions, 5 of them not answered by it), through the real
ingest worker, retrieval, the inference worker and the bundled SmolLM2: no answer loops or
leaks the prompt's turn markers; every answer cites a passage holding its key fact or says
it could not find it; questions the handbook does not answer, and users without documents,
get "not found"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.test import TestCase

from bench.answers import loops
from kvservice.protocol.prompt import TURN_MARKERS
from kvservice.serve.citing import cited_ranks, says_not_found
from tests.e2e.test_chat_e2e import collect_stream, upload_ready, wait_recorded
from webapp.chat import services as chat
from webapp.chat.models import Message
from webapp.dashboard.models import DashboardSettings
from webapp.dashboard.selectors import dashboard_settings

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HANDBOOK = Path(__file__).resolve().parents[1] / "data" / "handbook"
QUESTIONS = json.loads((HANDBOOK / "questions.json").read_text())["questions"]


def ask(user, conversation, question: str) -> tuple[Message, str]:
    with TestCase.captureOnCommitCallbacks(execute=True):
        answer = chat.chat_ask(user=user, conversation=conversation, question=question)
    _tokens, kind, payload = collect_stream(str(answer.request_id))
    assert kind == "done", payload
    wait_recorded(answer)
    return answer, payload["text"]


def grounded(answer: Message, text: str, fact: str | None) -> bool:
    """Cites a passage holding the fact, or says it could not find the answer."""
    citations = list(answer.citations.order_by("rank"))
    cited = [citations[rank - 1].text for rank in cited_ranks(text, len(citations))]
    holds_fact = fact is not None and any(fact.lower() in passage.lower() for passage in cited)
    return holds_fact or says_not_found(text)


def test_handbook_answers_are_grounded_or_not_found_and_never_loop(
    celery_worker_process, inference_worker_process, django_user_model
) -> None:
    # The loading controller chooses the ratio from timings, which a loaded machine changes
    # (and with it a 135M model's answer): a fixed ratio makes the answers the same on any
    # machine. At 0.15 the work-from-home question was answered "27" (leave.md's number)
    # with the float32 products (ENGINE_KERNEL onednn); at 0.25 all 19 hold with the torch,
    # onednn and onednn-bf16 kernels alike (the kernel is also chosen by timing).
    row = dashboard_settings()
    row.controller_mode, row.fixed_recompute_ratio = DashboardSettings.ControllerMode.FIXED, 0.25
    row.save()
    newcomer = django_user_model.objects.create_user(username="newcomer", password="new-pass1")
    _answer, text = ask(
        newcomer, chat.conversation_create(owner=newcomer), QUESTIONS[0]["question"]
    )
    assert text == chat.NOTHING_FOUND  # no documents: nothing is invented

    user = django_user_model.objects.create_user(username="employee", password="employee-pass")
    for path in sorted(HANDBOOK.iterdir()):
        if path.name != "questions.json":
            upload_ready(user, path.read_text(), path.name)

    results = []
    for item in QUESTIONS:  # each in a conversation of its own
        answer, text = ask(user, chat.conversation_create(owner=user), item["question"])
        results.append((item, answer, text))
    conversation = chat.conversation_create(owner=user)  # and a few as one conversation
    for item in QUESTIONS[:5]:
        answer, text = ask(user, conversation, item["question"])
        results.append((item, answer, text))

    report = [
        {
            "question": item["question"],
            "answer": text,
            "loops": loops(text),
            "grounded": grounded(answer, text, item["fact"]),
            "not_found": says_not_found(text),
        }
        for item, answer, text in results
    ]
    print(json.dumps(report, indent=1))
    assert not [r for r in report if r["loops"]]
    assert not [r for r in report if any(m in r["answer"] for m in TURN_MARKERS)]
    assert [r for r in report if not r["grounded"]] == []
    absent = [r for (item, _a, _t), r in zip(results, report, strict=True) if not item["fact"]]
    assert absent and all(r["not_found"] for r in absent)
