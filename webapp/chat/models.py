"""Conversations, their messages, and what each answer cited and measured."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from webapp.documents.selectors import Scope


class Conversation(models.Model):
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations"
    )
    title = models.CharField(max_length=200, default="New conversation")

    # Where it was started: the browser's chat lists only its own; the API's are listed by
    # the API (one per /v1/chat/completions call would otherwise bury them).
    class Source(models.TextChoices):
        BROWSER = "browser", "browser"
        API = "api", "API"

    source = models.CharField(max_length=16, choices=Source.choices, default=Source.BROWSER)
    # What its questions search: these collections and documents (those the owner may still
    # read at each question), or with none chosen, all of the owner's own documents. A chosen
    # scope whose collections and documents were all deleted stays chosen, and reads nothing.
    scope_collections = models.ManyToManyField("documents.Collection", related_name="+", blank=True)
    scope_documents = models.ManyToManyField("documents.Document", related_name="+", blank=True)
    scope_chosen = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-updated_at", "-id"]
        indexes = [models.Index(fields=["owner", "-updated_at"])]

    def __str__(self) -> str:
        return self.title

    @property
    def scope(self) -> Scope:
        return Scope.of(
            self.scope_collections.values_list("id", flat=True),
            self.scope_documents.values_list("id", flat=True),
            chosen=self.scope_chosen,
        )


class MessageQuerySet(models.QuerySet):
    def shown(self) -> MessageQuerySet:
        """The conversation as its reader sees it: without the answers regenerated since."""
        return self.filter(replaced_by__isnull=True)


class Message(models.Model):
    class Role(models.TextChoices):
        USER = "user", "User"
        ASSISTANT = "assistant", "Assistant"

    class Status(models.TextChoices):
        PENDING = "pending", "Waiting for the model"
        STREAMING = "streaming", "Streaming"
        DONE = "done", "Done"
        STOPPED = "stopped", "Stopped"
        FAILED = "failed", "Failed"

    class Mode(models.TextChoices):
        BLEND = "blend", "blend (CacheBlend)"
        FULL = "full", "full prefill"
        REUSE = "reuse", "full KV reuse"
        PREFIX = "prefix", "prefix caching"

    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="messages"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField(blank=True)
    # The model's words when no passage supports them: the answer is then "not found"
    # (``content``, kvservice.serve.citing.UNSUPPORTED), and these are kept apart, marked as such.
    withheld_text = models.TextField(blank=True)
    # The parts of a question in several parts that no passage answers (retrieval's
    # ``parts_not_found``): the page and the API say so with the answer, whatever the model
    # wrote (the bundled model, told, mostly left them out or dropped the part it could answer).
    parts_not_found = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DONE)
    error_message = models.TextField(blank=True)
    # The inference request that produced this answer (its token stream's name in Redis).
    request_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    mode = models.CharField(max_length=16, choices=Mode.choices, blank=True)
    recompute_ratio = models.FloatField(null=True, blank=True)
    # Progressive blend: the ratio the cache was upgraded to after the first token (None:
    # not upgraded), and when the second token came (seconds, as ttft_s).
    refresh_ratio = models.FloatField(null=True, blank=True)
    # Time to the first token: the worker's own (from when it took the request), and as the
    # user sees it (``ttft_seen_s``: from ``asked_at`` to the first token on the answer's
    # stream, retrieval and the queue included), which the page shows.
    ttft_s = models.FloatField(null=True, blank=True)
    ttft_seen_s = models.FloatField(null=True, blank=True)
    # From ``asked_at`` to the answer's last words on its stream, as the user saw it
    # (``webapp.answer_stream.total_seen_s``), which the page shows as "answered in".
    total_seen_s = models.FloatField(null=True, blank=True)
    second_token_s = models.FloatField(null=True, blank=True)
    total_s = models.FloatField(null=True, blank=True)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    # "length": the answer was cut at the token cap (it ends at a sentence, or with "…").
    finish_reason = models.CharField(max_length=16, blank=True)
    # How it was decoded: 0, greedy (a first answer); above, sampled with ``seed`` (an answer
    # asked again: webapp.chat.requests.REGENERATE_TEMPERATURE).
    temperature = models.FloatField(default=0.0)
    seed = models.BigIntegerField(null=True, blank=True)
    # Which tier served each cited chunk's KV, e.g. {"cpu": 4, "s3": 2}.
    tiers = models.JSONField(default=dict, blank=True)
    feedback = models.SmallIntegerField(default=0)  # -1 thumbs down, 0 none, +1 thumbs up
    # The answer regenerated in this one's place: it takes this one's time (and so its place
    # in the conversation), and this one is kept, unseen, for the dashboard's measures.
    replaced_by = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="replaces"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # When this answer was asked for (``created_at`` is its place in the conversation, which
    # an answer asked again takes over from the one it replaces).
    asked_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    objects = MessageQuerySet.as_manager()

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["mode", "created_at"])]

    def __str__(self) -> str:
        return f"{self.role}: {self.content[:40]}"

    OPEN = (Status.PENDING, Status.STREAMING)  # an answer not written to its end yet

    @property
    def is_open(self) -> bool:
        return self.status in self.OPEN

    @property
    def was_cut(self) -> bool:
        """It reached the longest answer the model may write, and was cut there."""
        return self.finish_reason == "length"

    @property
    def earlier_attempts(self) -> list[Message]:
        """The answers Regenerate replaced with this one, the latest first: kept, and shown
        under it, so that asking again never loses an answer."""
        earlier, current = [], self
        while True:
            try:
                current = current.replaces
            except Message.DoesNotExist:
                return earlier
            earlier.append(current)

    @property
    def from_prefix_cache(self) -> bool:
        """Every passage's KV came from the prefix cache: no recompute ratio ran."""
        return bool(self.tiers) and set(self.tiers) == {"prefix"}

    @property
    def sources(self) -> list[Citation]:
        """The passages the answer cites inline."""
        return [c for c in self.citations.all() if c.cited]

    @property
    def also_retrieved(self) -> list[Citation]:
        """The passages given to the model that the answer does not cite."""
        return [c for c in self.citations.all() if not c.cited]


class Citation(models.Model):
    """Chunk ``rank`` (1-based, the [n] in the answer) given to the model for a message.

    The chunk's text is copied so that a citation still reads right after its document is
    deleted (then ``chunk`` becomes null)."""

    message = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="citations")
    rank = models.PositiveSmallIntegerField()
    chunk = models.ForeignKey(
        "documents.Chunk", null=True, on_delete=models.SET_NULL, related_name="+"
    )
    document = models.ForeignKey(
        "documents.Document", null=True, on_delete=models.SET_NULL, related_name="+"
    )
    document_title = models.CharField(max_length=255)
    text = models.TextField()
    tier = models.CharField(max_length=16, blank=True)
    # Retrieval's view of the chunk (webapp.chat.retrieval): cosine similarity, full-text
    # term coverage (0..1), and the score the relevance threshold applies to.
    score = models.FloatField(null=True, blank=True)
    similarity = models.FloatField(null=True, blank=True)
    text_rank = models.FloatField(null=True, blank=True)
    # Whether the answer cites it inline ([rank]): cited passages are its sources, the
    # others were only retrieved. The cited sentence's span in ``text``, when one supports it.
    cited = models.BooleanField(default=False)
    highlight_start = models.PositiveIntegerField(null=True, blank=True)
    highlight_end = models.PositiveIntegerField(null=True, blank=True)

    @property
    def highlighted(self) -> tuple[str, str, str] | None:
        """(before, cited sentence, after) of the passage, when a sentence is highlighted."""
        if self.highlight_start is None or self.highlight_end is None:
            return None
        start, end = self.highlight_start, self.highlight_end
        return self.text[:start], self.text[start:end], self.text[end:]

    class Meta:
        ordering = ["message", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["message", "rank"], name="citation_unique_rank")
        ]
