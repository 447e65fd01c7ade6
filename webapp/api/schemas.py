"""Request and response shapes of /api/v1 (the OpenAPI schema is generated from these)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from django.conf import settings
from ninja import Field, Schema
from pydantic import AfterValidator, ConfigDict

from webapp.unstorable import unstorable_reason


def _storable(text: str) -> str:
    if reason := unstorable_reason(text):
        raise ValueError(reason)
    return text


Id = Annotated[int, Field(ge=1, le=2**63 - 1)]
# A string a request hands on to be stored. The database cannot store a NUL character or a lone
# surrogate (webapp/unstorable.py): one is a 422 naming the field here, not a 500 in whichever
# service stores it.
Text = Annotated[str, AfterValidator(_storable)]
DocumentStatus = Literal["queued", "processing", "ready", "failed"]
Mode = Literal["blend", "full", "reuse", "prefix"]


class DocumentCreatedOut(Schema):
    id: int
    status: DocumentStatus


class DocumentOut(Schema):
    id: int
    title: str
    status: DocumentStatus
    progress: int = Field(ge=0, le=100)
    error: str
    stage: str
    size_bytes: int
    created_at: datetime
    updated_at: datetime
    read_only: bool  # in a collection shared with you: you can read it, not change it


class UsageOut(Schema):
    """What the caller uses of their quotas (a maximum of 0: unlimited)."""

    documents: int
    max_documents: int
    tokens: int  # documents' chunks and texts stored through /kdn/v1 together
    max_tokens: int
    kdn_tokens: int  # of ``tokens``: the texts stored through /kdn/v1 (PUT /kdn/v1/kv)
    kv_bytes: int  # stored, as its codec wrote it
    max_kv_bytes: int
    kv_bytes_per_token: float | None  # None until some KV is stored
    compression_ratio: float | None  # fp16's bytes over the stored bytes


class DocumentListOut(Schema):
    count: int
    items: list[DocumentOut]


class CitationOut(Schema):
    rank: int  # the [n] of the answer
    document_id: int | None
    chunk_id: int | None
    document_title: str
    text: str
    cited: bool = False  # the answer cites it inline
    score: float | None = None  # retrieval's relevance score (cosine + full-text bonus)
    # The passage's sentence that supports the answer (a cited passage's, when one does).
    highlight: str | None = None


class RetrievedOut(Schema):
    rank: int
    chunk_id: int | None
    score: float | None
    similarity: float | None
    text_rank: float | None


class MetricsOut(Schema):
    ttft_s: float | None  # the worker's time to first token, from when it took the request
    # From the question's submit to the first token on the answer's stream: what a user
    # waits for (retrieval and the queue included), as the chat page shows it.
    ttft_seen_s: float | None = None
    total_s: float | None
    mode: str
    # The share of the passages' tokens recomputed (3 decimals); None where no ratio ran,
    # as for an answer served whole from the prefix cache (``from_prefix_cache``).
    recompute_ratio: float | None
    from_prefix_cache: bool = False
    tiers: dict[str, int]
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Every passage retrieval gave the model, with its scores (none: "not found").
    retrieval: list[RetrievedOut] = []
    not_found: bool = False  # nothing relevant was retrieved; nothing was generated
    # How the answer cites: "model" (its own [n]), "attributed" (the worker added the [n] of
    # the passage holding its words), "unsupported", "not_found".
    citation: str | None = None


class QueryIn(Schema):
    model_config = ConfigDict(extra="forbid")

    question: Text = Field(min_length=1, max_length=settings.CHAT_MAX_QUESTION_CHARS)
    mode: Mode = "blend"
    conversation_id: int | None = Field(default=None, ge=1, le=2**63 - 1)
    stream: bool = False
    # What the conversation searches from this question on: these collections and documents
    # (yours, or of collections shared with you). Both omitted: unchanged (a new
    # conversation searches all your own documents); both empty: all your own documents.
    collection_ids: list[Id] | None = Field(default=None, max_length=100)
    document_ids: list[Id] | None = Field(default=None, max_length=100)


class QueryOut(Schema):
    answer: str
    # The model's words when no passage supports them: ``answer`` is then "not found" and
    # ``metrics.citation`` "unsupported" (a stream sent the words, then marked them withdrawn).
    withheld: str = ""
    # The parts of a question in several parts that no passage answers ("where can I park
    # my bike"): the answer covers the others only.
    parts_not_found: list[str] = []
    citations: list[CitationOut]  # the passages the answer cites
    also_retrieved: list[CitationOut] = []  # given to the model, not cited
    metrics: MetricsOut
    conversation_id: int
    message_id: int


class ConversationOut(Schema):
    id: int
    title: str
    created_at: datetime
    updated_at: datetime


class ConversationListOut(Schema):
    count: int
    items: list[ConversationOut]


class MessageOut(Schema):
    id: int
    role: Literal["user", "assistant"]
    content: str
    withheld: str = ""  # an unsupported answer's words (as QueryOut.withheld)
    parts_not_found: list[str] = []  # as QueryOut.parts_not_found
    status: str
    error: str
    mode: str
    created_at: datetime
    citations: list[CitationOut]
    also_retrieved: list[CitationOut] = []
    metrics: MetricsOut | None


class ScopeOut(Schema):
    """What a conversation searches: these collections and documents, or with ``everything``
    all of its owner's own documents. Both empty without ``everything``: what it searched was
    deleted (or unshared), and it searches nothing until another scope is named."""

    collection_ids: list[int]
    document_ids: list[int]
    everything: bool


class ConversationDetailOut(ConversationOut):
    scope: ScopeOut
    messages: list[MessageOut]


class CollectionOut(Schema):
    id: int
    name: str
    owner: str  # the owner's username
    read_only: bool  # shared with you by its owner: you can search it, not change it
    document_ids: list[int]
    created_at: datetime
    updated_at: datetime


class CollectionIn(Schema):
    name: Text = Field(min_length=1, max_length=200)
    document_ids: list[Id] = Field(default_factory=list, max_length=1000)  # your own documents
    shared_with: list[Text] = Field(default_factory=list, max_length=100)  # usernames, read-only


class CollectionPatch(Schema):
    """What to change; what is left out stays as it is."""

    name: Text | None = Field(default=None, min_length=1, max_length=200)
    document_ids: list[Id] | None = Field(default=None, max_length=1000)
    shared_with: list[Text] | None = Field(default=None, max_length=100)


class CollectionListOut(Schema):
    count: int
    items: list[CollectionOut]


class ModeStatsOut(Schema):
    mode: str
    answers: int
    mean_ttft_s: float | None
    mean_total_s: float | None
    mean_recompute_ratio: float | None


class CacheStatsOut(Schema):
    chunks: dict[str, int]  # chunk count by KV status: pending, ready, failed
    kv_objects: int  # distinct stored KV objects (identical chunks share one)
    tiers: dict[str, int]  # chunk loads served per tier, over all recorded answers
    modes: list[ModeStatsOut]
    worker: dict[str, object] | None  # the inference worker's heartbeat, None when down
