"""What the web app and the inference worker say to each other, in one package that imports
no torch (the web app reads it without loading the engine).

- ``requests``: a question goes to the ``inference`` Celery queue as
  ``GenerateRequest.to_dict()``; the tasks and queues of both sides.
- ``events``: the worker appends the answer's events to a Redis stream named
  ``answer_stream(request_id)``: ``token`` (a text delta), then exactly one of ``done`` (the
  outcome) / ``error``. The first token's entry id dates the first words. Stop: the web app
  sets ``stop_key(request_id)``; the worker checks it between tokens.
- ``outcome``: how the answer ended (``AnswerOutcome``), built once by the worker with its
  metrics and what it made of each passage. The worker also reports it with the
  ``RECORD_TASK`` Celery task, on a queue of its own, so the answer is stored even if nobody
  is watching the stream.
- ``inflight``: which worker is writing which answer, and whether it still lives; the web
  side's reaper ends the answers of dead, lost or stuck workers.
- The heartbeat (kvservice/serve/heartbeat.py) carries the worker's live state for the dashboard.
- ``keys``: a chunk's content hash (``token_ids_sha256``), which both sides name chunks by.
- ``routing``: which worker's queue a question goes to (each worker advertises the chunks it
  holds hot); imported as the module ``kvservice.protocol.routing``.

The names below are the package's whole surface: import them from ``kvservice.protocol``.
"""

from kvservice.protocol.events import (
    STREAM_MAXLEN,
    STREAM_TTL_S,
    TokenEvent,
    answer_stream,
    decode_events,
    first_token_time_s,
    last_token_time_s,
    publish_event,
    request_stop,
    stop_key,
    stop_requested,
)
from kvservice.protocol.inflight import (
    ALIVE_INTERVAL_S,
    ALIVE_TTL_S,
    INFLIGHT_GRACE_S,
    INFLIGHT_KEY,
    WORKERS_KEY,
    inflight_abandon,
    inflight_add,
    inflight_entries,
    inflight_has,
    inflight_overdue,
    inflight_remove,
    mark_alive,
    worker_alive,
    worker_alive_key,
)
from kvservice.protocol.keys import token_ids_sha256
from kvservice.protocol.outcome import AnswerOutcome, PassageUse
from kvservice.protocol.requests import (
    EVICT_TASK,
    GENERATE_TASK,
    INFERENCE_QUEUE,
    RECORD_QUEUE,
    RECORD_TASK,
    WARM_TASK,
    ChunkRef,
    GenerateRequest,
    Turn,
)

__all__ = [
    "ALIVE_INTERVAL_S", "ALIVE_TTL_S", "EVICT_TASK", "GENERATE_TASK", "INFERENCE_QUEUE",
    "INFLIGHT_GRACE_S", "INFLIGHT_KEY", "RECORD_QUEUE", "RECORD_TASK", "STREAM_MAXLEN",
    "STREAM_TTL_S", "WARM_TASK", "WORKERS_KEY", "AnswerOutcome", "ChunkRef", "GenerateRequest",
    "PassageUse", "TokenEvent", "Turn", "answer_stream", "decode_events", "first_token_time_s",
    "inflight_abandon", "inflight_add", "inflight_entries", "inflight_has", "inflight_overdue",
    "inflight_remove", "last_token_time_s", "mark_alive", "publish_event", "request_stop",
    "stop_key", "stop_requested", "token_ids_sha256", "worker_alive", "worker_alive_key",
]  # fmt: skip
