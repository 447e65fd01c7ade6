"""Every environment variable Ragblend reads, each declared once: its name, type, default and
one line of doc. The web app (Django settings), the inference worker (``WorkerConfig``), the
store (``StoreConfig``), ingest and the launcher all read their variables here, so a variable
means one thing everywhere and a bad value is refused with its name, by every process alike.

    read("CHUNK_TOKENS")             # 512 unless the environment says otherwise
    read("KV_PREAMBLE", {"KV_PREAMBLE": "on"})  # from a mapping (tests, child processes)

A variable that is unset, or set to blank text (what Compose's ``${NAME:-}`` gives), takes
its default; ``keep_blank`` variables take blank text as given. Nothing is read at import:
``read`` looks at the environment when it is called.

``python -m kvservice.protocol.environment --markdown`` writes docs/configuration.md.

The model (``MODEL_PATH``'s fingerprint) and ``KV_PREAMBLE`` are part of every chunk key:
ingest, which stores chunk KV, and the inference worker, which looks it up, must agree on
them (the worker says at start when its keys match none of the stored chunks'; see
``kvservice.config.stored_keys_disagreement``).

Torch-free, like the rest of ``kvservice.protocol``: the web app imports it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvservice.protocol.codecs import DEFAULT_CODEC
from kvservice.protocol.requests import INFERENCE_QUEUE


class ConfigurationError(ValueError):
    """A variable's value that cannot be used; the message names the variable."""


@dataclass(frozen=True)
class Kind:
    """How a variable's text becomes its value: ``parse`` raises ``ValueError`` saying what
    was expected; ``name`` is the type as docs/configuration.md shows it."""

    name: str
    parse: Callable[[str], Any]


@dataclass(frozen=True)
class Variable:
    name: str
    kind: Kind
    default: Any
    doc: str
    section: str
    shown_default: str | None = None  # the docs' words where the default is derived
    keep_blank: bool = False  # blank text is a value ("" for KV_S3_PREFIX), not "unset"

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value in ``environ`` (default: the process environment), else the default."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or (not raw.strip() and not self.keep_blank):
            return self.default
        try:
            return self.kind.parse(raw)
        except ValueError as err:
            raise ConfigurationError(f"{self.name} {err}") from None

    @property
    def default_text(self) -> str:
        """The default as docs/configuration.md shows it."""
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None or self.default == "" or self.default == []:
            return "unset"
        if isinstance(self.default, bool):
            return "`true`" if self.default else "`false`"
        if isinstance(self.default, list):
            return f"`{','.join(self.default)}`"
        if self.kind is SIZE:
            return f"`{_format_size(self.default)}`"
        return f"`{self.default}`"


# --- kinds -------------------------------------------------------------------------------------


def _text(strip: bool = False) -> Kind:
    return Kind("text", (lambda s: s.strip()) if strip else str)


def _integer(minimum: int | None = None, maximum: int | None = None) -> Kind:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"must be a whole number, not {text!r}") from None
        _check_range(value, minimum, maximum, text)
        return value

    return Kind(_ranged("integer", minimum, maximum), parse)


def _number(minimum: float | None = None, above: float | None = None) -> Kind:
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"must be a number, not {text!r}") from None
        if math.isnan(value):
            raise ValueError(f"must be a number, not {text!r}")
        if above is not None and not value > above:
            raise ValueError(f"must be above {above:g}, not {text!r}")
        _check_range(value, minimum, None, text)
        return value

    name = f"number > {above:g}" if above is not None else _ranged("number", minimum, None)
    return Kind(name, parse)


def _check_range(value: float, minimum: float | None, maximum: float | None, text: str) -> None:
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise ValueError(f"must be {minimum:g} to {maximum:g}, not {text!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"must be at least {minimum:g}, not {text!r}")


def _ranged(name: str, minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f"{name} {minimum:g}-{maximum:g}"
    return f"{name} >= {minimum:g}" if minimum is not None else name


_TRUE = {"1", "true", "yes", "on", "y", "ok"}  # django-environ's, which the settings used
_FALSE = {"0", "false", "no", "off", "n"}


def _parse_flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"must be true or false, not {text!r}")


def _parse_auto_flag(text: str) -> bool | None:
    """None for ``auto``: the code decides (e.g. where CUDA is)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _parse_flag(text)
    except ValueError:
        raise ValueError(f"must be auto, true or false, not {text!r}") from None


FLAG = Kind("true/false", _parse_flag)
AUTO_FLAG = Kind("auto/true/false", _parse_auto_flag)


def choice(*options: str) -> Kind:
    """One of ``options`` (any case, outer spaces ignored)."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ValueError(f"must be {_alternatives(options)}, not {value!r}")
        return value

    return Kind(" / ".join(options), parse)


def _alternatives(options: Sequence[str]) -> str:
    quoted = [repr(option) for option in options]
    if len(quoted) == 2:
        return f"{quoted[0]} or {quoted[1]}"
    return f"one of {', '.join(quoted)}"


_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """``512MiB``, ``2GiB``, ``1.5GB`` or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB or plain bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _sized(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise ValueError(f"is {err}") from None


SIZE = Kind("size (512MiB, 2GiB, bytes)", _sized)


NAMES = Kind(
    "comma-separated list", lambda s: [part.strip() for part in s.split(",") if part.strip()]
)
PATH = Kind("path", lambda s: Path(s.strip()).expanduser())


def _parse_ratio(text: str) -> float:
    try:
        ratio = float(text.strip())
    except ValueError:
        ratio = math.nan
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"must be a ratio above 0 and at most 1, like 0.25, not {text!r}")
    return ratio


def _parse_refresh_ratio(text: str) -> float | None:
    """None: off (``off`` or 0); else a ratio above 0."""
    value = text.strip().lower()
    if value in ("off", "0", "0.0"):
        return None
    try:
        return _parse_ratio(value)
    except ValueError:
        message = f"must be off, or a ratio above 0 and at most 1 like 0.25, not {text!r}"
        raise ValueError(message) from None


def _parse_step_budget(text: str) -> float | None:
    """None: auto; ``math.inf``: off; else seconds above 0."""
    value = text.strip().lower()
    if value == "auto":
        return None
    if value == "off":
        return math.inf
    try:
        seconds = float(value.removesuffix("s"))
    except ValueError:
        seconds = -1.0
    if not 0.0 < seconds < math.inf:
        raise ValueError(f"must be auto, off, or seconds above 0 like 0.2, not {text!r}")
    return seconds


def _parse_rate(text: str) -> str:
    if not re.fullmatch(r"[1-9]\d*/\d*[smhd]", text.strip()):
        raise ValueError(
            f"must be a count per period, such as '20/m' or '10/h' (s, m, h or d), not {text!r}."
        )
    return text.strip()


RATIO = Kind("ratio (0, 1]", _parse_ratio)
REFRESH_RATIO = Kind("ratio (0, 1] / off", _parse_refresh_ratio)
STEP_BUDGET = Kind("auto / off / seconds", _parse_step_budget)
RATE = Kind("count/period (20/m)", _parse_rate)

# --- the variables -----------------------------------------------------------------------------

VARIABLES: dict[str, Variable] = {}


def _section(title: str) -> Callable[..., None]:
    """The declaring function for one section of docs/configuration.md."""

    def declare(name: str, kind: Kind, default: Any, doc: str, **options: Any) -> None:
        if name in VARIABLES:
            raise AssertionError(f"{name} is declared twice")
        VARIABLES[name] = Variable(name, kind, default, doc, title, **options)

    return declare


_declare = _section("Where things are")
_declare(
    "DATA_DIR",
    _text(),
    ".ragblend",
    "all local state (the dev stack's, the disk tier's); "
    "relative to the working directory unless absolute",
)
_declare(
    "MODEL_PATH",
    _text(strip=True),
    "",
    "the LLM: a model directory or a .gguf file; part of every chunk key (its fingerprint)",
    shown_default="the bundled SmolLM2-135M",
)
_declare(
    "RAGBLEND_MODEL_CACHE",
    PATH,
    None,
    "converted model weights, shared by every stack of the machine",
    shown_default="~/.cache/ragblend/models",
)

_declare = _section("Services")
_declare(
    "DATABASE_URL",
    _text(strip=True),
    "",
    "PostgreSQL with pgvector (the web app and its Celery worker; required outside a dev stack)",
)
_declare(
    "REDIS_URL",
    _text(strip=True),
    "",
    "valkey/Redis: the broker, the answer streams, the cache (required outside a dev stack)",
)
_declare(
    "S3_ENDPOINT",
    _text(strip=True),
    "",
    "host:port of the S3 gateway (documents and chunk KV; unset: the store has no S3 tier)",
)
_declare(
    "S3_ACCESS_KEY",
    _text(),
    "",
    "S3 credentials",
    shown_default="empty (the dev launcher: ragblend)",
)
_declare("S3_SECRET_KEY", _text(), "", "S3 credentials")
_declare("S3_SECURE", FLAG, False, "S3 over HTTPS")
_declare("S3_REGION", _text(strip=True), None, "the S3 region, where the gateway needs one")
_declare("S3_DOCUMENTS_BUCKET", _text(), "documents", "the bucket of uploaded files")

_declare = _section("Web app")
_declare("DEBUG", FLAG, False, "Django's debug mode (dev only)")
_declare(
    "SECRET_KEY",
    _text(),
    "",
    "Django's signing key: 50+ random characters outside DEBUG "
    "(required; the dev launcher makes one)",
)
_declare("ALLOWED_HOSTS", NAMES, ["127.0.0.1", "localhost"], "host names the web app answers to")
_declare(
    "CSRF_TRUSTED_ORIGINS", NAMES, [], "origins trusted for unsafe requests (https://example.com)"
)
_declare(
    "DB_CONN_MAX_AGE", _integer(0), 0, "seconds a database connection is kept (0: per request)"
)
_declare(
    "HTTPS",
    FLAG,
    None,
    "secure cookies, HTTP redirected to HTTPS, HSTS",
    shown_default="true unless DEBUG",
)
_declare(
    "SECURE_COOKIES", FLAG, None, "session and CSRF cookies only over HTTPS", shown_default="HTTPS"
)
_declare(
    "HSTS_SECONDS",
    _integer(0),
    None,
    "Strict-Transport-Security's max-age",
    shown_default="a year with HTTPS, else 0",
)
_declare("BEHIND_TLS_PROXY", FLAG, False, "trust X-Forwarded-Proto from the proxy that ends TLS")
_declare("HSTS_INCLUDE_SUBDOMAINS", FLAG, False, "HSTS for the whole domain's subdomains")
_declare("HSTS_PRELOAD", FLAG, False, "ask browsers to preload HSTS")
_declare(
    "TRUSTED_PROXY_COUNT",
    _integer(0),
    0,
    "proxies in front that append to X-Forwarded-For (1 behind the Kubernetes ingress)",
)
_declare(
    "STATIC_ROOT",
    _text(strip=True),
    "",
    "where collectstatic writes (unset: served from the app's directories)",
)
_declare("LOG_LEVEL", _text(strip=True), "INFO", "the web app's log level")
_declare(
    "WEB_WARM_UP", FLAG, True, "load the embedding model at start (false: on the first question)"
)
_declare(
    "HEALTH_PING_TIMEOUT_S",
    _number(above=0),
    1.0,
    "how long /healthz waits for a Celery worker's ping",
)
_declare("HEALTH_CACHE_S", _number(0), 5.0, "how long /healthz reuses a failed check")
_declare(
    "HEALTH_TIMEOUT_S",
    _number(above=0),
    None,
    "how long /healthz and /readyz wait for their checks; longer than HEALTH_PING_TIMEOUT_S",
    shown_default="3, or HEALTH_PING_TIMEOUT_S + 1.5 if longer",
)

_declare = _section("Accounts")
_declare("SIGNUP_ENABLED", FLAG, False, "self sign-up (off: staff add and invite users)")
_declare("INVITE_VALID_DAYS", _integer(1, 90), 7, "days an invite link works")
_declare(
    "LOGIN_FAILURE_LIMIT",
    _integer(1),
    5,
    "wrong passwords for one username from one address before a lockout",
)
_declare("LOGIN_LOCKOUT_MINUTES", _integer(0), 15, "how long that lockout lasts")
_declare(
    "LOGIN_ACCOUNT_FAILURE_LIMIT",
    _integer(1),
    10,
    "wrong passwords for one username from any addresses before its password logins pause",
)
_declare("LOGIN_ACCOUNT_LOCKOUT_MINUTES", _integer(1), 15, "how long that pause lasts")
_declare("LOGIN_RATE_LIMIT", RATE, "20/m", "login POSTs per client address")
_declare("SIGNUP_RATE_LIMIT", RATE, "10/h", "sign-up POSTs per client address")
_declare(
    "ADMIN_USERNAME", _text(strip=True), "admin", "the first admin account (manage.py ensure_admin)"
)
_declare("ADMIN_PASSWORD", _text(), "", "its password", shown_default="random, printed once")
_declare("ADMIN_EMAIL", _text(strip=True), "", "its e-mail address")

_declare = _section("Documents and ingest")
_declare("MAX_UPLOAD_BYTES", _integer(1), 25 * 1024 * 1024, "largest file accepted")
_declare(
    "MAX_REQUEST_BYTES",
    _integer(1),
    None,
    "largest request body, refused as it arrives",
    shown_default="4 x MAX_UPLOAD_BYTES",
)
_declare("DATA_UPLOAD_MAX_NUMBER_FILES", _integer(1), 50, "files in one request")
_declare("CHUNK_TOKENS", _integer(1), 512, "a chunk's size in the LLM's tokens")
_declare(
    "DOCX_MAX_UNCOMPRESSED_BYTES",
    _integer(1),
    200 * 1024 * 1024,
    "a .docx unpacking to more is refused",
)
_declare("DOCX_MAX_COMPRESSION_RATIO", _integer(1), 100, "a .docx compressed more is refused")
_declare("PARSE_MAX_MEMORY_MB", _integer(1), 2048, "memory of the process parsing a file")
_declare("PARSE_TIMEOUT_S", _integer(1), 120, "CPU seconds of the process parsing a file")
_declare("QUOTA_DOCUMENTS", _integer(0), 1000, "documents per user (0: unlimited)")
_declare("QUOTA_TOKENS", _integer(0), 1_000_000, "tokens of text per user (0: unlimited)")
_declare(
    "KV_BYTES_PER_TOKEN",
    _integer(1),
    30 * 2 * 3 * 64 * 2,
    "chunk KV per token, for the quota's figures (the bundled model's in 16 bits)",
)
_declare(
    "KV_CACHE_SCOPE",
    choice("user", "shared"),
    "user",
    "whose chunk KV objects are "
    "shared: each user's apart, or identical text stored once for everyone",
)
_declare("KV_PRECOMPUTE_BATCH", _integer(1), 8, "chunks per KV precompute task")
_declare(
    "WORKER_MAX_MEMORY_MB", _integer(1), 3072, "a Celery pool process grown past this is replaced"
)
_declare(
    "WORKER_TORCH_THREADS",
    _integer(1),
    None,
    "torch threads of each Celery pool process",
    shown_default="the cores / the pool's processes",
)
_declare(
    "WORKER_NICE",
    _integer(0, 19),
    10,
    "how far Celery pool processes lower their CPU priority, giving way to inference",
)
_declare("WORKER_WARM_UP", FLAG, True, "Celery pool processes load their models at start")

_declare = _section("Chat and API")
_declare("RETRIEVAL_TOP_K", _integer(1), 6, "passages retrieved per question")
_declare(
    "RETRIEVAL_MIN_SCORE",
    _number(0),
    0.475,
    "passages scoring below are not given to the model (0: keep them all)",
)
_declare(
    "INFERENCE_MAX_BACKLOG",
    _integer(0),
    32,
    "questions waiting for the model before a new one is refused with 503 (0: never)",
)
_declare("CHAT_MAX_NEW_TOKENS", _integer(1), 160, "an answer's length cap, in tokens")
_declare("CHAT_MAX_QUESTION_CHARS", _integer(1), 4000, "a question's length cap")
_declare("API_RATE_LIMIT_REQUESTS", _integer(1), 120, "requests per user per window")
_declare("API_RATE_LIMIT_WINDOW_S", _integer(1), 60, "that window, in seconds")
_declare(
    "API_ANSWER_TIMEOUT_S",
    _number(above=0),
    300.0,
    "how long an answer (or a quiet stream) is awaited before a 504",
)
_declare(
    "ANSWER_PENDING_LIMIT_S",
    _number(above=0),
    None,
    "an answer no worker took is ended after this",
    shown_default="API_ANSWER_TIMEOUT_S + 30",
)
_declare("REAPER_INTERVAL_S", _number(above=0), 5.0, "how often unfinished answers are checked")
_declare(
    "RATIO_CURVE_PATH",
    _text(strip=True),
    "docs/ratio_curve.json",
    "the measured ratio curve: the dashboard draws it, target mode reads it on the model it"
    " was measured on (relative to the repository)",
)
_declare(
    "SERVING_BENCH_DIR",
    _text(strip=True),
    "docs",
    "where the dashboard finds the serving bench's reports",
)

_declare = _section("Knowledge delivery (/kdn/v1)")
_declare("KDN_MAX_TEXTS", _integer(1), 64, "texts per fetch")
_declare("KDN_MAX_TEXT_CHARS", _integer(1), 64_000, "a text's characters")
_declare("KDN_MAX_TEXT_TOKENS", _integer(1), 4096, "a text's tokens")
_declare("KDN_PUT_WAIT_S", _number(above=0), 120.0, "how long a PUT waits for the KV worker")
_declare("KDN_MAX_BODY_BYTES", _integer(1), 2 * 1024 * 1024, "a body over this is a 413")
_declare("KDN_TOKEN_TTL_S", _number(above=0), 120.0, "a signed passage token's lifetime")
_declare(
    "KDN_URL",
    _text(strip=True),
    "",
    "the web server whose API the KV source kdn (and the client) reads",
)
_declare("KDN_KEY", _text(strip=True), "", "an API key, for the client (KdnClient.from_env)")
_declare(
    "KDN_TIMEOUT_S",
    _number(above=0),
    None,
    "a KDN request's read timeout",
    shown_default="60 (the inference worker), 600 (the client)",
)

_declare = _section("Inference worker")
_declare(
    "ENGINE",
    choice("native", "vllm"),
    "native",
    "the serving engine: kvservice's own, or vLLM with blended KV",
)
_declare("INFERENCE_QUEUE", _text(strip=True), INFERENCE_QUEUE, "the Celery queue questions go to")
_declare(
    "INFERENCE_NODE_NAME",
    _text(strip=True),
    "inference@%h",
    "the worker's Celery name (several on one host need their own)",
)
_declare(
    "INFERENCE_CONCURRENCY",
    _integer(1),
    8,
    "answers written at once (as many more wait in the worker's line)",
)
_declare(
    "ENGINE_PRECISION",
    choice("float32", "auto"),
    "auto",
    "the native engine's products "
    "(auto: bfloat16 where the CPU has it natively), in ingest's KV as in the worker's",
)
_declare(
    "ENGINE_KERNEL",
    choice("torch", "onednn", "onednn-bf16"),
    None,
    "one linear kernel instead of the fastest measured",
    shown_default="the fastest measured",
)
_declare("ENGINE_COMPILE", choice("on", "off"), "on", "passes recorded as CUDA graphs on a GPU")
_declare("ENGINE_BUFFER_BYTES", SIZE, 1 << 30, "CPU buffers kept for the next request")
_declare(
    "ENGINE_STEP_BUDGET",
    STEP_BUDGET,
    None,
    "prefill work per batch step beside the open answers",
    shown_default="auto",
)
_declare(
    "BLEND_REFRESH_RATIO",
    REFRESH_RATIO,
    0.25,
    "progressive blend: the ratio a blend's cache is upgraded to after the first token "
    "(off: not upgraded)",
)
_declare("PREFIX_CACHE_BYTES", SIZE, 1 << 30, "the prefix cache's capacity")
_declare(
    "KV_SOURCE",
    choice("s3", "kdn"),
    "s3",
    "where the worker reads chunk KV: S3, or the knowledge delivery API at KDN_URL",
)
# On, on Musique: validation 20-39, reuse's KL to full 0.116 -> 0.076 (better on 19 of 20),
# blend's 0.042 -> 0.039 at 0.10 (12 of 20); tuning 1-19: reuse -43 %, blend -3 % / +2 % at
# 0.10 / 0.15. Off by default: with it the product's handbook test (tests/e2e/test_handbook.py,
# short company documents) got answers that quote the wrong passage (docs/blend.md).
_declare(
    "KV_PREAMBLE",
    choice("on", "off"),
    "off",
    "chunk KV computed after the shipped "
    "retrieval preamble; part of every chunk key: ingest and the worker must agree",
)
_declare(
    "HEARTBEAT_KEY",
    _text(strip=True),
    "ragblend:inference:heartbeat",
    "the Redis key of the worker's heartbeat (two workers on one Redis need their own)",
)

_declare = _section("KV store")
_declare("KV_S3_BUCKET", _text(strip=True), "kvcache", "the bucket of chunk KV objects")
_declare("KV_S3_PREFIX", _text(), "kv/", "key prefix inside that bucket", keep_blank=True)
_declare("KV_S3_CONNECT_TIMEOUT_S", _number(above=0), 1.0, "S3 connect timeout")
_declare("KV_S3_READ_TIMEOUT_S", _number(above=0), 10.0, "S3 read timeout")
_declare("KV_S3_RETRIES", _integer(0), 1, "retries on connection errors and 5xx")
_declare(
    "KV_S3_DOWN_BACKOFF_S",
    _number(0),
    5.0,
    "after S3 is found unreachable, fail fast for this long",
)
_declare("KV_DEVICE_CAPACITY_BYTES", SIZE, 0, "the device-memory tier (needs CUDA; 0: off)")
_declare("KV_CPU_CAPACITY_BYTES", SIZE, 2 << 30, "the CPU-memory tier")
_declare(
    "KV_CPU_PINNED",
    AUTO_FLAG,
    None,
    "hold the CPU tier in page-locked memory",
    shown_default="auto (where CUDA is)",
)
_declare("KV_DISK_CAPACITY_BYTES", SIZE, 20 << 30, "the local-disk tier (0: off)")
_declare(
    "KV_DISK_DIR",
    _text(strip=True),
    None,
    "the local-disk tier's directory",
    shown_default="DATA_DIR/kv-disk",
)
_declare(
    "KV_CODEC",
    Kind("codec name", lambda s: s.strip().lower()),
    None,
    "how new objects store K and V: fp16, int8, fp8, kivi4... (stored objects keep theirs)",
    shown_default=f"`{DEFAULT_CODEC}`",
)
_declare("KV_QUANTIZE", FLAG, False, "the switch before KV_CODEC: true means KV_CODEC=int8")
_declare(
    "KV_STORE_DTYPE",
    choice("float32", "float16", "bfloat16"),
    "float16",
    "float32 KV stored (fp16) or decoded as this type",
)
_declare("KV_LOAD_WORKERS", _integer(1), 16, "background fetch threads of the loader")
_declare("KV_STREAM_THREADS", _integer(1), 2, "threads reading the chunks S3 streams")
_declare("KV_PREFETCH_DEPTH", _integer(0), 2, "layers fetched ahead of the one in use")
_declare("KV_LOAD_NICE", _integer(0, 19), 0, "how far the fetch threads lower their priority")

_declare = _section("vLLM engine (ENGINE=vllm)")
_declare(
    "VLLM_GPU_MEMORY_UTILIZATION",
    _number(above=0),
    0.3,
    "share of GPU memory (on CPU: of RAM) vLLM takes",
)
_declare("VLLM_MAX_MODEL_LEN", _integer(1), 4096, "longest prompt and answer")
_declare("VLLM_MAX_NUM_SEQS", _integer(1), 8, "requests batched together")
_declare(
    "VLLM_DTYPE",
    _text(strip=True),
    None,
    "the weights' dtype",
    shown_default="float32 on CPU, auto on GPU",
)
_declare("VLLM_ENFORCE_EAGER", FLAG, None, "skip graph compilation", shown_default="true on CPU")

_declare = _section("Dev launcher (make dev)")
_declare("PORT", _integer(1, 65535), 8000, "the web server's port")
_declare("CELERY_CONCURRENCY", _integer(1), 2, "the Celery worker's pool processes")
_declare("INFERENCE_WORKERS", _integer(1), 1, "inference workers sharing the S3 tier")


# --- reading -----------------------------------------------------------------------------------


def variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in kvservice.protocol.environment") from None


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """``name``'s value in ``environ`` (default: the process environment), else its default;
    a ``ConfigurationError`` naming it for a bad value."""
    return variable(name).read(environ)


def markdown() -> str:
    """docs/configuration.md: a table per section."""
    lines = [
        "# Configuration",
        "",
        "Every environment variable Ragblend reads, by the part that reads it. Unset or blank",
        "means the default. A bad value stops the process at start with the variable's name.",
        "Generated by `python -m kvservice.protocol.environment --markdown`",
        "(from kvservice/protocol/environment.py): edit that, not this file.",
    ]
    sections: dict[str, list[Variable]] = {}
    for each in VARIABLES.values():
        sections.setdefault(each.section, []).append(each)
    for section, variables in sections.items():
        lines += [
            "",
            f"## {section}",
            "",
            "| variable | type | default | what |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{v.name}` | {v.kind.name} | {v.default_text} | {v.doc} |" for v in variables]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/configuration.md")
    parser.parse_args(argv)
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
