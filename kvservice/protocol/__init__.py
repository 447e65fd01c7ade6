"""What the web app and the inference worker say to each other, in one package that imports
no torch (the web app reads it without loading the engine).

- ``requests``: a question goes to the ``inference`` Celery queue as
  ``GenerateRequest.to_dict()``; the tasks and queues of both sides.
- ``events``: an answer's typed events on a Redis stream named ``answer_stream(request_id)``:
  ``Token`` (a text delta, the worker's), then exactly one of ``Done`` (the outcome) /
  ``Error``, appended once the outcome is recorded. The first token's entry id dates the
  first words. Stop: the web app sets ``stop_key(request_id)``; the worker checks it between
  tokens.
- ``outcome``: how the answer ended (``AnswerOutcome``, its measurements ``AnswerMetrics``),
  built once by the worker with what it made of each passage, and sent once: with the
  ``RECORD_TASK`` Celery task, on a queue of its own, so the answer is stored even if nobody
  is watching the stream; that task then ends the stream.
- ``inflight``: which worker is writing which answer, and whether it still lives; the web
  side's reaper ends the answers of dead, lost or stuck workers.
- ``heartbeat``: the worker's live state (alive, its model, its tiers) for /healthz and the
  dashboard; ``deadlines``: the timeouts on every Redis call, both sides'. Imported as modules
  (``kvservice.protocol.heartbeat``, ``kvservice.protocol.deadlines``).
- ``keys``: a chunk's content hash (``token_ids_sha256``), which both sides name chunks by,
  and its KV object's address (``ChunkKey``).
- ``prompt``: the prompt's layout in token ids (``PromptFormat``: the head chunks are computed
  after, a chunk's own tokens), which ingest and the worker must build alike for chunk keys
  to match.
- The stored KV as data and bytes: ``codecs`` (the named codecs, ``KV_CODEC``), ``objects``
  (a chunk object's header), ``kdn_stream`` (the knowledge delivery stream and its server
  side), ``errors`` (the store's typed faults), ``curve`` (the measured ratio curve). Each
  imported as a module (``kvservice.protocol.codecs``...).
- ``ratio``: the recompute ratio's one default (``DEFAULT_RECOMPUTE_RATIO``) and the
  operator's setting turned into a request's ratios (a fidelity target read on a curve
  measured on the running model), which the dashboard shows and the worker's planner takes
  up; imported as the module ``kvservice.protocol.ratio``.
- ``routing``: which worker's queue a question goes to (each worker advertises the chunks it
  holds hot); imported as the module ``kvservice.protocol.routing``.
- ``environment``: every environment variable either side reads, declared once (type,
  default, doc); imported as the module ``kvservice.protocol.environment``.
- ``models``: where the models' files are (the bundled ones, ``MODEL_PATH``'s checkpoint, the
  tokenizer ingest chunks with) and the checks on a ``MODEL_PATH``, without converting
  anything; imported as the module ``kvservice.protocol.models``.

The names below are the package's whole surface: import them from ``kvservice.protocol``.
"""

from kvservice.protocol.events import (
    STREAM_MAXLEN,
    STREAM_TTL_S,
    Done,
    End,
    Error,
    ErrorCode,
    Queue,
    StreamEvent,
    Token,
    TokenEvent,
    answer_stream,
    decode_events,
    end_of,
    first_token_time_s,
    last_token_time_s,
    outcome_of,
    publish_event,
    request_stop,
    stop_key,
    stop_requested,
    stream_ended,
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
from kvservice.protocol.metrics import AnswerMetrics
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
    "ALIVE_INTERVAL_S",
    "ALIVE_TTL_S",
    "EVICT_TASK",
    "GENERATE_TASK",
    "INFERENCE_QUEUE",
    "INFLIGHT_GRACE_S",
    "INFLIGHT_KEY",
    "RECORD_QUEUE",
    "RECORD_TASK",
    "STREAM_MAXLEN",
    "STREAM_TTL_S",
    "WARM_TASK",
    "WORKERS_KEY",
    "AnswerMetrics",
    "AnswerOutcome",
    "ChunkRef",
    "Done",
    "End",
    "Error",
    "ErrorCode",
    "GenerateRequest",
    "PassageUse",
    "Queue",
    "StreamEvent",
    "Token",
    "TokenEvent",
    "Turn",
    "answer_stream",
    "decode_events",
    "end_of",
    "first_token_time_s",
    "outcome_of",
    "stream_ended",
    "inflight_abandon",
    "inflight_add",
    "inflight_entries",
    "inflight_has",
    "inflight_overdue",
    "inflight_remove",
    "last_token_time_s",
    "mark_alive",
    "publish_event",
    "request_stop",
    "stop_key",
    "stop_requested",
    "token_ids_sha256",
    "worker_alive",
    "worker_alive_key",
]
