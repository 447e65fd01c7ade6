"""OpenAI-compatible endpoints, /v1: ``POST /v1/chat/completions`` and ``GET /v1/models``,
so existing OpenAI clients work unchanged (``base_url=<site>/v1``, ``api_key=<API key>``).

The last user message is the question; earlier user/assistant messages are its history. The
answer is retrieved and blended over the caller's own documents, as in the chat. Extra, non-
standard fields: ``citations`` (what the answer cites) and ``ragblend`` (metrics and ids)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.http import HttpRequest
from ninja import NinjaAPI, Schema
from pydantic import ConfigDict, Field

from kvservice.protocol import AnswerMetrics, AnswerOutcome, Queue, Token, outcome_of
from webapp.answer_stream import AnswerTimeout, sse
from webapp.api import answers
from webapp.api.auth import API_AUTH
from webapp.api.errors import ApiError, install_error_handlers, stream_error, unavailable
from webapp.api.schemas import Id, Text
from webapp.api.services import completion_ask
from webapp.api.v1 import event_stream_response, scope_of
from webapp.chat.models import Message
from webapp.chat.requests import mode_allowed
from webapp.chat.services import AnswerServiceUnavailable, ChatError, ScopeNotFound

MODEL = "ragblend"  # blend; staff may also ask for "ragblend-full", "-reuse", "-prefix"
CREATED = 1_767_225_600  # models' nominal creation time (2026-01-01)

openai_api = NinjaAPI(
    title="Ragblend OpenAI-compatible API",
    version="1",
    auth=API_AUTH,
    urls_namespace="openai_v1",
)

_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout",
}


def _openai_error(error: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error")
    return {"error": {"message": error.message, "type": kind, "code": error.code, "param": None}}


install_error_handlers(openai_api, _openai_error)


class ContentPart(Schema):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


class ChatMessageIn(Schema):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""


class ChatCompletionIn(Schema):
    # Sampling and other OpenAI options are accepted and ignored (answers are greedy).
    model_config = ConfigDict(extra="allow")
    model: Text = Field(min_length=1, max_length=100)
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=200)
    stream: bool = False
    # Not OpenAI's: search only these collections and documents (as /api/v1/query).
    collection_ids: list[Id] | None = Field(default=None, max_length=100)
    document_ids: list[Id] | None = Field(default=None, max_length=100)


def _models_for(user) -> list[str]:
    modes = [mode for mode in Message.Mode.values if mode_allowed(user, mode)]
    return [MODEL if mode == Message.Mode.BLEND else f"{MODEL}-{mode}" for mode in modes]


def _mode_for(request: HttpRequest, model: str) -> str:
    if model == MODEL:
        return Message.Mode.BLEND
    mode = model.removeprefix(f"{MODEL}-")
    if model.startswith(f"{MODEL}-") and mode in Message.Mode.values:
        if not mode_allowed(request.user, mode):
            raise ApiError(403, "model_not_allowed", f"Only staff can use {model!r}.")
        return mode
    raise ApiError(404, "model_not_found", f"The model {model!r} does not exist; use {MODEL!r}.")


@openai_api.get("/models")
def list_models(request: HttpRequest):
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": CREATED, "owned_by": "ragblend"}
            for name in _models_for(request.user)
        ],
    }


def _usage(metrics: AnswerMetrics) -> dict[str, int]:
    prompt = int(metrics.prompt_tokens or 0)
    completion = int(metrics.completion_tokens or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish_reason(metrics: AnswerMetrics) -> str:
    """OpenAI's ``finish_reason``: the worker's, "stop" for an answer that reports none."""
    return metrics.finish_reason or "stop"


def _extras(answer: Message, result: AnswerOutcome) -> dict[str, Any]:
    """``citations`` (what the answer cites), ``also_retrieved`` and ``ragblend`` (with
    ``withheld``: the words of an answer no passage supports, whose content is "not found";
    a stream sent them, then marked them withdrawn; ``parts_not_found``: the parts of the
    question no passage answers)."""
    return {
        **answers.sources_of(answer, result),
        "ragblend": {
            "conversation_id": answer.conversation_id,
            "message_id": answer.pk,
            "withheld": result.withheld,
            "parts_not_found": answer.parts_not_found,
            "metrics": answers.metrics_of(answer, result.metrics),
        },
    }


def _chunk(answer: Message, model: str, delta: dict, finish: str | None = None) -> dict:
    return {
        "id": f"chatcmpl-{answer.request_id}",
        "object": "chat.completion.chunk",
        "created": int(answer.created_at.timestamp()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


async def _completion_events(answer: Message, model: str) -> AsyncIterator[str]:
    """OpenAI's chunks, then ``[DONE]``; an error ends it as OpenAI's stream does, with an
    ``{"error": ...}`` object (OpenAI's clients raise it), then ``[DONE]`` for the others."""
    yield sse(None, _chunk(answer, model, {"role": "assistant", "content": ""}))
    try:
        async for event in answers.answer_events(str(answer.request_id)):
            if isinstance(event, Token):
                yield sse(None, _chunk(answer, model, {"content": event.text}))
                continue
            if isinstance(event, Queue):  # OpenAI's stream has none: a comment keeps it open
                yield ": waiting for the model\n\n"
                continue
            result = outcome_of(event)  # the last event, once the answer is recorded
            if not result.ok:
                yield sse(None, _openai_error(ApiError(502, "generation_failed", result.error)))
                continue
            last = _chunk(answer, model, {}, finish=_finish_reason(result.metrics))
            extras = await sync_to_async(_extras)(answer, result)
            last |= {"usage": _usage(result.metrics)} | extras
            yield sse(None, last)
    except AnswerTimeout as err:
        yield sse(None, _openai_error(ApiError(504, "timeout", str(err))))
    except Exception as err:  # a service lost mid-stream: the client gets an end, not a cut
        yield sse(None, _openai_error(stream_error(err, conversation_id=answer.conversation_id)))
    yield sse(None, "[DONE]")


@openai_api.post("/chat/completions")
def chat_completions(request: HttpRequest, payload: ChatCompletionIn):
    mode = _mode_for(request, payload.model)
    try:
        answer = completion_ask(
            user=request.user,
            turns=[(m.role, m.text()) for m in payload.messages],
            mode=mode,
            scope=scope_of(payload),
        )
    except AnswerServiceUnavailable as err:
        raise unavailable(str(err)) from err
    except ScopeNotFound as err:
        raise ApiError(404, "not_found", str(err)) from err
    except ChatError as err:
        raise ApiError(400, "invalid_request", str(err)) from err
    if payload.stream:
        return event_stream_response(_completion_events(answer, payload.model))
    try:
        result = answers.wait_for_answer(answer)
    except AnswerTimeout as err:
        raise ApiError(504, "timeout", str(err)) from err
    if not result.ok:
        raise ApiError(502, "generation_failed", result.error)
    return {
        "id": f"chatcmpl-{answer.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": payload.model,
        "choices": [
            {
                "index": 0,
                "finish_reason": _finish_reason(result.metrics),
                "message": {"role": "assistant", "content": result.text},
            }
        ],
        "usage": _usage(result.metrics),
    } | _extras(answer, result)
