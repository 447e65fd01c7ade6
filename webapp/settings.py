"""The one settings module. Everything that differs between dev, CI and production comes
from environment variables, each declared once (type, default, doc) in
``kvservice.protocol.environment`` and read here with ``read``; a bad value stops the web app
at start, naming the variable (docs/configuration.md lists them). In dev, unset service URLs
are filled from the running stack's ``DATA_DIR/stack.json`` (see deploy/stack.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

from deploy.stack import apply_stack_env, data_dir
from kvservice.protocol import deadlines
from kvservice.protocol.environment import read

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = data_dir()
apply_stack_env(DATA_DIR)


def _or_derived(name: str, derived: Any) -> Any:
    """``name``'s value, or ``derived`` where it is unset: a default that depends on another
    setting (the registry says on which)."""
    value = read(name)
    return derived if value is None else value


DEBUG = read("DEBUG")
SECRET_KEY = read("SECRET_KEY")
if not SECRET_KEY:
    raise ImproperlyConfigured(
        "SECRET_KEY is not set: export it (production), or start the stack with `make dev`, "
        "which generates one under DATA_DIR."
    )
# Outside DEBUG, a guessable key (sessions, CSRF and password-reset tokens are signed with
# it) is refused at start, by the rule of Django's own deploy check (W009).
if not DEBUG and (
    len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5 or SECRET_KEY.startswith("django-insecure-")
):
    raise ImproperlyConfigured(
        "SECRET_KEY is too weak: use at least 50 random characters, e.g. "
        '`python -c "import secrets; print(secrets.token_urlsafe(48))"`.'
    )
ALLOWED_HOSTS = read("ALLOWED_HOSTS")
CSRF_TRUSTED_ORIGINS = read("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "django_htmx",
    "ninja",  # its vendored Swagger UI static files (the API docs never load a CDN)
    "axes",  # login throttling
    "webapp.accounts",
    "webapp.documents",
    "webapp.chat",
    "webapp.dashboard",
    "webapp.kdn",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "webapp.outages.ServiceUnavailableMiddleware",  # a dead service: 503, not a 500
    "webapp.unstorable.RefuseUnstorableText",  # a NUL in a form: 400, not a 500
    "axes.middleware.AxesMiddleware",  # last, as django-axes requires
]
# Error reports and the DEBUG page hide settings holding URLs with passwords too.
DEFAULT_EXCEPTION_REPORTER_FILTER = "webapp.outages.ReporterFilter"

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"
WSGI_APPLICATION = "webapp.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
            "builtins": ["webapp.units"],  # number formats (kib, count, seconds) everywhere
        },
    },
]

if not read("DATABASE_URL"):
    raise ImproperlyConfigured(
        "DATABASE_URL is not set: point it at PostgreSQL with pgvector, or run `make dev` "
        f"(DATA_DIR={DATA_DIR} has no running stack)."
    )
DATABASES = {"default": environ.Env.db_url_config(read("DATABASE_URL"))}  # django-environ's parser
DATABASES["default"]["CONN_MAX_AGE"] = read("DB_CONN_MAX_AGE")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Login throttling (django-axes): after AXES_FAILURE_LIMIT wrong passwords for one username
# from one address, that pair is locked out for AXES_COOLOFF_TIME (a 429 page); a success
# resets the count.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = read("LOGIN_FAILURE_LIMIT")
AXES_COOLOFF_TIME = timedelta(minutes=read("LOGIN_LOCKOUT_MINUTES"))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "accounts/locked.html"
# Renders AXES_LOCKOUT_TEMPLATE with Retry-After, as the rate limits' 429 (ratelimits.py).
AXES_LOCKOUT_CALLABLE = "webapp.accounts.ratelimits.axes_lockout_response"
AXES_VERBOSE = False
# Per account, from any addresses (webapp/accounts/ratelimits.py): this many wrong passwords
# for one username within LOGIN_ACCOUNT_LOCKOUT pause its password logins for that long.
LOGIN_ACCOUNT_FAILURE_LIMIT = read("LOGIN_ACCOUNT_FAILURE_LIMIT")
LOGIN_ACCOUNT_LOCKOUT = timedelta(minutes=read("LOGIN_ACCOUNT_LOCKOUT_MINUTES"))
# Proxies in front of the web server that append to X-Forwarded-For (1 behind the Kubernetes
# ingress): who a client is for axes and the rate limits (webapp/accounts/addresses.py).
TRUSTED_PROXY_COUNT = read("TRUSTED_PROXY_COUNT")
AXES_CLIENT_IP_CALLABLE = "webapp.accounts.addresses.client_ip"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "webapp" / "static"]
# Production runs `collectstatic` into STATIC_ROOT; without it WhiteNoise serves straight from
# the app's static directories (fine at this size, and nothing to forget in dev).
STATIC_ROOT = read("STATIC_ROOT") or None
WHITENOISE_USE_FINDERS = STATIC_ROOT is None

# HTTPS (on by default outside DEBUG): secure cookies, redirect plain HTTP (not the health
# endpoints, which probes call over HTTP), HSTS. Behind a proxy that ends TLS, set
# BEHIND_TLS_PROXY so the proxy's X-Forwarded-Proto says whether the request was secure.
HTTPS = _or_derived("HTTPS", not DEBUG)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = _or_derived("SECURE_COOKIES", HTTPS)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_SSL_REDIRECT = HTTPS
SECURE_REDIRECT_EXEMPT = [r"^(healthz|livez|readyz)$"]
SECURE_HSTS_SECONDS = _or_derived("HSTS_SECONDS", 365 * 24 * 3600 if HTTPS else 0)
if read("BEHIND_TLS_PROXY"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# HSTS for subdomains, and preloading, bind the operator's whole domain: theirs to opt into.
SECURE_HSTS_INCLUDE_SUBDOMAINS = read("HSTS_INCLUDE_SUBDOMAINS")
SECURE_HSTS_PRELOAD = read("HSTS_PRELOAD")
SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]
X_FRAME_OPTIONS = "DENY"

# --- services --------------------------------------------------------------------------------

REDIS_URL = read("REDIS_URL")
S3_ENDPOINT = read("S3_ENDPOINT")
S3_ACCESS_KEY = read("S3_ACCESS_KEY")
S3_SECRET_KEY = read("S3_SECRET_KEY")
S3_SECURE = read("S3_SECURE")
S3_DOCUMENTS_BUCKET = read("S3_DOCUMENTS_BUCKET")
# The chunk-KV bucket under the store's own variable, so the web side creates and checks the
# bucket the workers write to.
S3_KV_BUCKET = read("KV_S3_BUCKET")
S3_KV_PREFIX = read("KV_S3_PREFIX")  # the web side deletes and streams KV objects by name
# The LLM whose tokenizer chunks documents and whose KV is precomputed: a local HF checkpoint
# directory, or "" for the bundled SmolLM2 (kvservice.model.bundled.resolve_llm_path).
MODEL_PATH = read("MODEL_PATH")
# The native engine's products, in ingest's KV precompute as in the inference worker
# (kvservice.model.kernels): auto (the default: bfloat16 where the CPU has it natively), or float32.
ENGINE_PRECISION = read("ENGINE_PRECISION")
for _name, _value in [("REDIS_URL", REDIS_URL), ("S3_ENDPOINT", S3_ENDPOINT)]:
    if not _value:
        raise ImproperlyConfigured(f"{_name} is not set, and DATA_DIR={DATA_DIR} has no stack.")
# Django's cache is valkey, shared by every web process, so a count kept in it holds across
# them: the sign-up and login rate limits (webapp/accounts/ratelimits.py).
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "ragblend:cache",
        # The web app's Redis deadlines (kvservice/protocol/deadlines.py), not redis-py's defaults.
        "OPTIONS": deadlines.redis_options(),
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "ingest"
CELERY_TASK_ROUTES = {
    "worker.tasks.ingest_*": {"queue": "ingest"},
    "worker.tasks.precompute_*": {"queue": "kv"},
}
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600, **deadlines.BROKER_TRANSPORT_OPTIONS}
# Deadlines on the result backend and on publishing, as the inference worker's app has them
# (kvservice.protocol.deadlines.celery_options): a frozen broker fails a send in seconds.
CELERY_REDIS_SOCKET_TIMEOUT = deadlines.REDIS_COMMAND_TIMEOUT_S
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = deadlines.REDIS_CONNECT_TIMEOUT_S
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"retry_policy": deadlines.CELERY_RETRY_POLICY}
CELERY_TASK_PUBLISH_RETRY_POLICY = deadlines.CELERY_RETRY_POLICY
# A pool process that grew past this (KiB) after a task is replaced: memory a parser or torch
# kept is given back. The LLM and the embedder take about 1.5 GB.
CELERY_WORKER_MAX_MEMORY_PER_CHILD = read("WORKER_MAX_MEMORY_MB") * 1024

# --- documents (upload, parsing, chunking, embedding) ------------------------------------------

MAX_UPLOAD_BYTES = read("MAX_UPLOAD_BYTES")
# Chunks are about this many tokens of the LLM's own tokenizer, split on sentence boundaries.
CHUNK_TOKENS = read("CHUNK_TOKENS")
EMBEDDING_DIM = 384  # all-MiniLM-L6-v2; the Chunk.embedding column is declared with it
# A .docx is a zip: refuse one that unpacks to more than this, or at a ratio above this.
DOCX_MAX_UNCOMPRESSED_BYTES = read("DOCX_MAX_UNCOMPRESSED_BYTES")
DOCX_MAX_COMPRESSION_RATIO = read("DOCX_MAX_COMPRESSION_RATIO")
# Per-user quotas (0: unlimited), shown to the user: documents, and tokens of text, which is
# also the KV cache stored for them (KV_BYTES_PER_TOKEN each: 22.5 KiB for the bundled
# SmolLM2-135M in 16 bits, 30 layers x K and V x 3 heads x 64; set it for another model).
QUOTA_DOCUMENTS = read("QUOTA_DOCUMENTS")
QUOTA_TOKENS = read("QUOTA_TOKENS")
KV_BYTES_PER_TOKEN = read("KV_BYTES_PER_TOKEN")
# The knowledge delivery API (/kdn/v1, docs/kdn.md): texts per fetch, a text's characters and
# tokens (a chunk of ingest is CHUNK_TOKENS), and how long a PUT waits for the KV worker.
KDN_MAX_TEXTS = read("KDN_MAX_TEXTS")
KDN_MAX_TEXT_CHARS = read("KDN_MAX_TEXT_CHARS")
KDN_MAX_TEXT_TOKENS = read("KDN_MAX_TEXT_TOKENS")
KDN_PUT_WAIT_S = read("KDN_PUT_WAIT_S")
# A /kdn/v1 body over this is a 413 as it arrives (webapp/asgi.py): 64 texts of 4,096 tokens
# of English are about 1.2 MB of JSON. Keep it within Django's DATA_UPLOAD_MAX_MEMORY_SIZE
# (2.5 MB), past which Django refuses to read a body (also a 413, webapp/api/errors.py).
KDN_MAX_BODY_BYTES = read("KDN_MAX_BODY_BYTES")
# Where the inference worker reads chunk KV (kvservice.kdn.client.KvSource reads the same
# variable): "s3", or "kdn" through /kdn/v1, with a token the web app signs for each passage
# of a question (webapp/kdn/tokens.py), at most KDN_TOKEN_TTL_S and the request's timeout.
# With "s3" no token is signed: none is needed, so none travels in the task messages.
KV_SOURCE = read("KV_SOURCE")
KDN_TOKEN_TTL_S = read("KDN_TOKEN_TTL_S")
# Parsing runs in a child process under these limits (webapp/documents/sandbox.py): a file
# that needs more memory or CPU time is refused, and the worker goes on.
PARSE_MAX_MEMORY_MB = read("PARSE_MAX_MEMORY_MB")
PARSE_TIMEOUT_S = read("PARSE_TIMEOUT_S")
# Whose chunk KV objects are shared: "user" (default) keeps each user's apart, so no timing or
# tier reveals that another user uploaded the same text; "shared" stores identical text once
# for everyone (for a single team that trusts itself: faster uploads of common text).
KV_CACHE_SCOPE = read("KV_CACHE_SCOPE")
# Chunks per KV precompute task (one forward pass batches them).
KV_PRECOMPUTE_BATCH = read("KV_PRECOMPUTE_BATCH")
# Requests carrying several files: allow a form's worth of them, and a whole request body of
# at most MAX_REQUEST_BYTES (refused with 413 as it arrives, before it is read: webapp/asgi.py).
DATA_UPLOAD_MAX_NUMBER_FILES = read("DATA_UPLOAD_MAX_NUMBER_FILES")
MAX_REQUEST_BYTES = _or_derived("MAX_REQUEST_BYTES", 4 * MAX_UPLOAD_BYTES)

# --- chat -------------------------------------------------------------------------------------

# The Celery queue the inference worker serves (kvservice.serve.server reads the same variable).
INFERENCE_QUEUE = read("INFERENCE_QUEUE")
# The inference worker's serving engine (kvservice.serve.server reads the same variable): "native"
# (kvservice's own engine) or "vllm" (vLLM, with cached/blended KV through kvservice.vllm).
ENGINE = read("ENGINE")
RETRIEVAL_TOP_K = read("RETRIEVAL_TOP_K")
# The web process loads the embedding model in the background at start (webapp/asgi.py), and
# /healthz reports it not ready until then; 0: loaded on the first question.
WEB_WARM_UP = read("WEB_WARM_UP")
# Chunks scoring below this (0.25 x cosine similarity + 0.75 x the share of the question's
# words they hold, webapp/chat/retrieval.py; tuned with bench/retrieval.py, docs/retrieval.md)
# are not given to the model; with none left the answer is "not found" (0: keep them all).
RETRIEVAL_MIN_SCORE = read("RETRIEVAL_MIN_SCORE")
# Admission control: with this many questions already waiting for the model, a new one is
# refused with 503 and Retry-After instead of queueing behind them (0: never refused).
INFERENCE_MAX_BACKLOG = read("INFERENCE_MAX_BACKLOG")
# An answer's length cap: answers are asked for in one or two sentences (20-40 tokens on the
# handbook questions); 256 let a loop run for 75 s before it was cut.
CHAT_MAX_NEW_TOKENS = read("CHAT_MAX_NEW_TOKENS")
CHAT_MAX_QUESTION_CHARS = read("CHAT_MAX_QUESTION_CHARS")

# --- API (webapp/api) ---------------------------------------------------------------------------

# Requests per user (all their API keys, their session's API calls and their questions in the
# browser) per fixed window; over it, 429 with Retry-After (webapp/accounts/ratelimits.py).
API_RATE_LIMIT_REQUESTS = read("API_RATE_LIMIT_REQUESTS")
API_RATE_LIMIT_WINDOW_S = read("API_RATE_LIMIT_WINDOW_S")
# How long a non-streamed answer (or a quiet stream) is awaited before a 504.
API_ANSWER_TIMEOUT_S = read("API_ANSWER_TIMEOUT_S")

# Answers nobody will finish are ended (webapp/chat/reaper.py), checked every
# REAPER_INTERVAL_S by Celery beat: those of a worker that died, at once; those no worker took,
# after ANSWER_PENDING_LIMIT_S (by then the browser and the API have stopped waiting).
ANSWER_PENDING_LIMIT_S = _or_derived("ANSWER_PENDING_LIMIT_S", API_ANSWER_TIMEOUT_S + 30)
REAPER_INTERVAL_S = read("REAPER_INTERVAL_S")
CELERY_BEAT_SCHEDULE = {
    "reap-stale-answers": {
        "task": "worker.chat.reap_stale_answers",
        "schedule": REAPER_INTERVAL_S,
        "options": {"expires": REAPER_INTERVAL_S},  # a backlog of them is pointless
    },
    # S3 objects of deleted documents that S3 did not take at once (it was down).
    "purge-orphan-objects": {
        "task": "worker.tasks.purge_orphan_objects",
        "schedule": 300.0,
        "options": {"expires": 300.0},
    },
}

# --- dashboard ------------------------------------------------------------------------------

# The measured quality/speed curve of the recompute ratio that the dashboard draws: the JSON
# written by `python -m kvservice.bench --ratios ... --json PATH` (relative to the repository
# root unless absolute). Absent until a validation run writes it.
RATIO_CURVE_PATH = BASE_DIR / read("RATIO_CURVE_PATH")
# The serving bench's reports (python -m bench.serving --json): the dashboard shows the newest
# one's capacity per mode (relative to the repository root unless absolute).
SERVING_BENCH_DIR = BASE_DIR / read("SERVING_BENCH_DIR")

# How long /healthz waits for a Celery worker to answer a ping, and reuses a check's failure
# (never an "up": webapp/health.py).
HEALTH_PING_TIMEOUT_S = read("HEALTH_PING_TIMEOUT_S")
HEALTH_CACHE_S = read("HEALTH_CACHE_S")
# How long /healthz and /readyz wait for their checks, run at once (webapp/health.py); a check
# not done by then is reported down. Under the probes' own timeouts (4-5 s in deploy/), and
# longer than a Celery ping, which waits out HEALTH_PING_TIMEOUT_S for every worker's reply.
HEALTH_TIMEOUT_S = _or_derived("HEALTH_TIMEOUT_S", max(3.0, HEALTH_PING_TIMEOUT_S + 1.5))
if HEALTH_TIMEOUT_S <= HEALTH_PING_TIMEOUT_S:
    raise ImproperlyConfigured(
        f"HEALTH_TIMEOUT_S ({HEALTH_TIMEOUT_S:g}) must be longer than HEALTH_PING_TIMEOUT_S "
        f"({HEALTH_PING_TIMEOUT_S:g})."
    )

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": read("LOG_LEVEL")},
}

# --- accounts -------------------------------------------------------------------------------

# Self sign-up at accounts/signup/ (off: the page is a 404 and staff add users from the
# product's Users page, invite them from its Invites page, or use Django admin).
SIGNUP_ENABLED = read("SIGNUP_ENABLED")
# An invite link (staff's Invites page) works once, for this many days unless staff say.
INVITE_VALID_DAYS = read("INVITE_VALID_DAYS")
# POSTs per client address to the login pages (ours and admin's) and to sign-up (with an
# invite or without), as a count per period: s, m, h or d, e.g. "20/m" or "10/h". Past it, a
# 429 until the period ends (webapp/accounts/ratelimits.py); axes still locks a username.
LOGIN_RATE_LIMIT = read("LOGIN_RATE_LIMIT")
SIGNUP_RATE_LIMIT = read("SIGNUP_RATE_LIMIT")
