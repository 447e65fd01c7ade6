"""The one settings module. Everything that differs between dev, CI and production comes
from environment variables (django-environ); in dev, unset service URLs are filled from the
running stack's ``DATA_DIR/stack.json`` (see deploy/stack.py)."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from deploy.stack import apply_stack_env, data_dir
from kvservice.serve import deadlines

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = data_dir()
apply_stack_env(DATA_DIR)

env = environ.Env()

DEBUG = env.bool("DEBUG", default=False)
SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    raise ImproperlyConfigured(
        "SECRET_KEY is not set: export it (production), or start the stack with `make dev`, "
        "which generates one under DATA_DIR."
    )
# Outside DEBUG, a guessable key (sessions, CSRF and password-reset tokens are signed with
# it) is refused at start, by the rule of Django's own deploy check (W009).
if not DEBUG and (len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5
                  or SECRET_KEY.startswith("django-insecure-")):  # fmt: skip
    raise ImproperlyConfigured(
        "SECRET_KEY is too weak: use at least 50 random characters, e.g. "
        '`python -c "import secrets; print(secrets.token_urlsafe(48))"`.'
    )
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

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

try:
    DATABASES = {"default": env.db_url("DATABASE_URL")}
except ImproperlyConfigured as err:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set: point it at PostgreSQL with pgvector, or run `make dev` "
        f"(DATA_DIR={DATA_DIR} has no running stack)."
    ) from err
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE", default=0)
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
AXES_FAILURE_LIMIT = env.int("LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("LOGIN_LOCKOUT_MINUTES", default=15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "accounts/locked.html"
# Renders AXES_LOCKOUT_TEMPLATE with Retry-After, as the rate limits' 429 (ratelimits.py).
AXES_LOCKOUT_CALLABLE = "webapp.accounts.ratelimits.axes_lockout_response"
AXES_VERBOSE = False
# Per account, from any addresses (webapp/accounts/ratelimits.py): this many wrong passwords
# for one username within LOGIN_ACCOUNT_LOCKOUT pause its password logins for that long.
LOGIN_ACCOUNT_FAILURE_LIMIT = env.int("LOGIN_ACCOUNT_FAILURE_LIMIT", default=10)
LOGIN_ACCOUNT_LOCKOUT = timedelta(minutes=env.int("LOGIN_ACCOUNT_LOCKOUT_MINUTES", default=15))
if LOGIN_ACCOUNT_FAILURE_LIMIT < 1 or LOGIN_ACCOUNT_LOCKOUT <= timedelta(0):
    raise ImproperlyConfigured(
        "LOGIN_ACCOUNT_FAILURE_LIMIT and LOGIN_ACCOUNT_LOCKOUT_MINUTES must be 1 or more, got "
        f"{LOGIN_ACCOUNT_FAILURE_LIMIT} and {LOGIN_ACCOUNT_LOCKOUT.total_seconds() / 60:g}."
    )
# Proxies in front of the web server that append to X-Forwarded-For (1 behind the Kubernetes
# ingress): who a client is for axes and the rate limits (webapp/accounts/addresses.py).
TRUSTED_PROXY_COUNT = env.int("TRUSTED_PROXY_COUNT", default=0)
if TRUSTED_PROXY_COUNT < 0:
    raise ImproperlyConfigured(f"TRUSTED_PROXY_COUNT must be 0 or more, got {TRUSTED_PROXY_COUNT}")
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
STATIC_ROOT = env.str("STATIC_ROOT", default="") or None
WHITENOISE_USE_FINDERS = STATIC_ROOT is None

# HTTPS (on by default outside DEBUG): secure cookies, redirect plain HTTP (not the health
# endpoints, which probes call over HTTP), HSTS. Behind a proxy that ends TLS, set
# BEHIND_TLS_PROXY so the proxy's X-Forwarded-Proto says whether the request was secure.
HTTPS = env.bool("HTTPS", default=not DEBUG)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env.bool("SECURE_COOKIES", default=HTTPS)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_SSL_REDIRECT = HTTPS
SECURE_REDIRECT_EXEMPT = [r"^(healthz|livez|readyz)$"]
SECURE_HSTS_SECONDS = env.int("HSTS_SECONDS", default=365 * 24 * 3600 if HTTPS else 0)
if env.bool("BEHIND_TLS_PROXY", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# HSTS for subdomains, and preloading, bind the operator's whole domain: theirs to opt into.
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = env.bool("HSTS_PRELOAD", default=False)
SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]
X_FRAME_OPTIONS = "DENY"

# --- services --------------------------------------------------------------------------------

REDIS_URL = env.str("REDIS_URL", default="")
S3_ENDPOINT = env.str("S3_ENDPOINT", default="")
S3_ACCESS_KEY = env.str("S3_ACCESS_KEY", default="")
S3_SECRET_KEY = env.str("S3_SECRET_KEY", default="")
S3_SECURE = env.bool("S3_SECURE", default=False)
S3_DOCUMENTS_BUCKET = env.str("S3_DOCUMENTS_BUCKET", default="documents")
# The chunk-KV bucket under the store's own variable (kvservice.store.config), so the web
# side creates and checks the bucket the workers write to.
S3_KV_BUCKET = env.str("KV_S3_BUCKET", default="kvcache")
# The LLM whose tokenizer chunks documents and whose KV is precomputed: a local HF checkpoint
# directory, or "" for the bundled SmolLM2 (kvservice.model.bundled.resolve_llm_path).
MODEL_PATH = env.str("MODEL_PATH", default="")
# The native engine's products, in ingest's KV precompute as in the inference worker
# (kvservice.model.kernels): auto (the default: bfloat16 where the CPU has it natively), or float32.
ENGINE_PRECISION = env.str("ENGINE_PRECISION", default="") or None
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
        # The web app's Redis deadlines (kvservice/serve/deadlines.py), not redis-py's defaults.
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
# (kvservice.serve.deadlines.celery_options): a frozen broker fails a send in seconds.
CELERY_REDIS_SOCKET_TIMEOUT = deadlines.REDIS_COMMAND_TIMEOUT_S
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = deadlines.REDIS_CONNECT_TIMEOUT_S
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"retry_policy": deadlines.CELERY_RETRY_POLICY}
CELERY_TASK_PUBLISH_RETRY_POLICY = deadlines.CELERY_RETRY_POLICY
# A pool process that grew past this (KiB) after a task is replaced: memory a parser or torch
# kept is given back. The LLM and the embedder take about 1.5 GB.
CELERY_WORKER_MAX_MEMORY_PER_CHILD = env.int("WORKER_MAX_MEMORY_MB", default=3072) * 1024

# --- documents (upload, parsing, chunking, embedding) ------------------------------------------

MAX_UPLOAD_BYTES = env.int("MAX_UPLOAD_BYTES", default=25 * 1024 * 1024)
# Chunks are about this many tokens of the LLM's own tokenizer, split on sentence boundaries.
CHUNK_TOKENS = env.int("CHUNK_TOKENS", default=512)
EMBEDDING_DIM = 384  # all-MiniLM-L6-v2; the Chunk.embedding column is declared with it
# A .docx is a zip: refuse one that unpacks to more than this, or at a ratio above this.
DOCX_MAX_UNCOMPRESSED_BYTES = env.int("DOCX_MAX_UNCOMPRESSED_BYTES", default=200 * 1024 * 1024)
DOCX_MAX_COMPRESSION_RATIO = env.int("DOCX_MAX_COMPRESSION_RATIO", default=100)
# Per-user quotas (0: unlimited), shown to the user: documents, and tokens of text, which is
# also the KV cache stored for them (KV_BYTES_PER_TOKEN each: 22.5 KiB for the bundled
# SmolLM2-135M in 16 bits, 30 layers x K and V x 3 heads x 64; set it for another model).
QUOTA_DOCUMENTS = env.int("QUOTA_DOCUMENTS", default=1000)
QUOTA_TOKENS = env.int("QUOTA_TOKENS", default=1_000_000)
KV_BYTES_PER_TOKEN = env.int("KV_BYTES_PER_TOKEN", default=30 * 2 * 3 * 64 * 2)
# The knowledge delivery API (/kdn/v1, docs/kdn.md): texts per fetch, a text's characters and
# tokens (a chunk of ingest is CHUNK_TOKENS), and how long a PUT waits for the KV worker.
KDN_MAX_TEXTS = env.int("KDN_MAX_TEXTS", default=64)
KDN_MAX_TEXT_CHARS = env.int("KDN_MAX_TEXT_CHARS", default=64_000)
KDN_MAX_TEXT_TOKENS = env.int("KDN_MAX_TEXT_TOKENS", default=4096)
KDN_PUT_WAIT_S = env.float("KDN_PUT_WAIT_S", default=120.0)
# A /kdn/v1 body over this is a 413 as it arrives (webapp/asgi.py): 64 texts of 4,096 tokens
# of English are about 1.2 MB of JSON. Keep it within Django's DATA_UPLOAD_MAX_MEMORY_SIZE
# (2.5 MB), past which Django refuses to read a body (also a 413, webapp/api/errors.py).
KDN_MAX_BODY_BYTES = env.int("KDN_MAX_BODY_BYTES", default=2 * 1024 * 1024)
# Where the inference worker reads chunk KV (kvservice.kdn.client.KvSource reads the same
# variable): "s3", or "kdn" through /kdn/v1, with a token the web app signs for each passage
# of a question (webapp/kdn/tokens.py), at most KDN_TOKEN_TTL_S and the request's timeout.
# With "s3" no token is signed: none is needed, so none travels in the task messages.
KV_SOURCE = env.str("KV_SOURCE", default="s3").strip().lower()
if KV_SOURCE not in ("s3", "kdn"):
    raise ImproperlyConfigured(f"KV_SOURCE must be 's3' or 'kdn', not {KV_SOURCE!r}")
KDN_TOKEN_TTL_S = env.float("KDN_TOKEN_TTL_S", default=120.0)
for _name, _value in [("KDN_MAX_BODY_BYTES", KDN_MAX_BODY_BYTES),
                      ("KDN_TOKEN_TTL_S", KDN_TOKEN_TTL_S)]:  # fmt: skip
    if _value <= 0:
        raise ImproperlyConfigured(f"{_name} must be positive, got {_value}.")
# Parsing runs in a child process under these limits (webapp/documents/sandbox.py): a file
# that needs more memory or CPU time is refused, and the worker goes on.
PARSE_MAX_MEMORY_MB = env.int("PARSE_MAX_MEMORY_MB", default=2048)
PARSE_TIMEOUT_S = env.int("PARSE_TIMEOUT_S", default=120)
# Whose chunk KV objects are shared: "user" (default) keeps each user's apart, so no timing or
# tier reveals that another user uploaded the same text; "shared" stores identical text once
# for everyone (for a single team that trusts itself: faster uploads of common text).
KV_CACHE_SCOPE = env.str("KV_CACHE_SCOPE", default="user")
if KV_CACHE_SCOPE not in ("user", "shared"):
    raise ImproperlyConfigured(f"KV_CACHE_SCOPE must be 'user' or 'shared', not {KV_CACHE_SCOPE!r}")
# Chunks per KV precompute task (one forward pass batches them).
KV_PRECOMPUTE_BATCH = env.int("KV_PRECOMPUTE_BATCH", default=8)
for _name, _value in [("MAX_UPLOAD_BYTES", MAX_UPLOAD_BYTES), ("CHUNK_TOKENS", CHUNK_TOKENS),
                      ("KV_PRECOMPUTE_BATCH", KV_PRECOMPUTE_BATCH)]:  # fmt: skip
    if _value < 1:
        raise ImproperlyConfigured(f"{_name} must be a positive integer, got {_value}.")
# Requests carrying several files: allow a form's worth of them, and a whole request body of
# at most MAX_REQUEST_BYTES (refused with 413 as it arrives, before it is read: webapp/asgi.py).
DATA_UPLOAD_MAX_NUMBER_FILES = env.int("DATA_UPLOAD_MAX_NUMBER_FILES", default=50)
MAX_REQUEST_BYTES = env.int("MAX_REQUEST_BYTES", default=4 * MAX_UPLOAD_BYTES)

# --- chat -------------------------------------------------------------------------------------

# The Celery queue the inference worker serves (kvservice.serve.server reads the same variable).
INFERENCE_QUEUE = env.str("INFERENCE_QUEUE", default="inference")
# The inference worker's serving engine (kvservice.serve.server reads the same variable): "native"
# (kvservice's own engine) or "vllm" (vLLM, with cached/blended KV through kvservice.vllm).
ENGINE = env.str("ENGINE", default="native").strip().lower()
if ENGINE not in ("native", "vllm"):
    raise ImproperlyConfigured(f"ENGINE must be 'native' or 'vllm', not {ENGINE!r}")
RETRIEVAL_TOP_K = env.int("RETRIEVAL_TOP_K", default=6)
# The web process loads the embedding model in the background at start (webapp/asgi.py), and
# /healthz reports it not ready until then; 0: loaded on the first question.
WEB_WARM_UP = env.bool("WEB_WARM_UP", default=True)
# Chunks scoring below this (0.25 x cosine similarity + 0.75 x the share of the question's
# words they hold, webapp/chat/retrieval.py; tuned with bench/retrieval.py, docs/retrieval.md)
# are not given to the model; with none left the answer is "not found" (0: keep them all).
RETRIEVAL_MIN_SCORE = env.float("RETRIEVAL_MIN_SCORE", default=0.475)
# Admission control: with this many questions already waiting for the model, a new one is
# refused with 503 and Retry-After instead of queueing behind them (0: never refused).
INFERENCE_MAX_BACKLOG = env.int("INFERENCE_MAX_BACKLOG", default=32)
# An answer's length cap: answers are asked for in one or two sentences (20-40 tokens on the
# handbook questions); 256 let a loop run for 75 s before it was cut.
CHAT_MAX_NEW_TOKENS = env.int("CHAT_MAX_NEW_TOKENS", default=160)
CHAT_MAX_QUESTION_CHARS = env.int("CHAT_MAX_QUESTION_CHARS", default=4000)

# --- API (webapp/api) ---------------------------------------------------------------------------

# Requests per user (all their API keys, their session's API calls and their questions in the
# browser) per fixed window; over it, 429 with Retry-After (webapp/accounts/ratelimits.py).
API_RATE_LIMIT_REQUESTS = env.int("API_RATE_LIMIT_REQUESTS", default=120)
API_RATE_LIMIT_WINDOW_S = env.int("API_RATE_LIMIT_WINDOW_S", default=60)
# How long a non-streamed answer (or a quiet stream) is awaited before a 504.
API_ANSWER_TIMEOUT_S = env.float("API_ANSWER_TIMEOUT_S", default=300.0)
for _name, _value in [("API_RATE_LIMIT_REQUESTS", API_RATE_LIMIT_REQUESTS),
                      ("API_RATE_LIMIT_WINDOW_S", API_RATE_LIMIT_WINDOW_S),
                      ("API_ANSWER_TIMEOUT_S", API_ANSWER_TIMEOUT_S)]:  # fmt: skip
    if _value <= 0:
        raise ImproperlyConfigured(f"{_name} must be positive, got {_value}.")

# Answers nobody will finish are ended (webapp/chat/reaper.py), checked every
# REAPER_INTERVAL_S by Celery beat: those of a worker that died, at once; those no worker took,
# after ANSWER_PENDING_LIMIT_S (by then the browser and the API have stopped waiting).
ANSWER_PENDING_LIMIT_S = env.float("ANSWER_PENDING_LIMIT_S", default=API_ANSWER_TIMEOUT_S + 30)
REAPER_INTERVAL_S = env.float("REAPER_INTERVAL_S", default=5.0)
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
RATIO_CURVE_PATH = BASE_DIR / env.str("RATIO_CURVE_PATH", default="docs/ratio_curve.json")
# The serving bench's reports (python -m bench.serving --json): the dashboard shows the newest
# one's capacity per mode (relative to the repository root unless absolute).
SERVING_BENCH_DIR = BASE_DIR / env.str("SERVING_BENCH_DIR", default="docs")

# How long /healthz waits for a Celery worker to answer a ping, and reuses a check's failure
# (never an "up": webapp/health.py).
HEALTH_PING_TIMEOUT_S = env.float("HEALTH_PING_TIMEOUT_S", default=1.0)
HEALTH_CACHE_S = env.float("HEALTH_CACHE_S", default=5.0)
# How long /healthz and /readyz wait for their checks, run at once (webapp/health.py); a check
# not done by then is reported down. Under the probes' own timeouts (4-5 s in deploy/), and
# longer than a Celery ping, which waits out HEALTH_PING_TIMEOUT_S for every worker's reply.
HEALTH_TIMEOUT_S = env.float("HEALTH_TIMEOUT_S", default=max(3.0, HEALTH_PING_TIMEOUT_S + 1.5))
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
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}

# --- accounts -------------------------------------------------------------------------------

# Self sign-up at accounts/signup/ (off: the page is a 404 and staff add users from the
# product's Users page, invite them from its Invites page, or use Django admin).
SIGNUP_ENABLED = env.bool("SIGNUP_ENABLED", default=False)
# An invite link (staff's Invites page) works once, for this many days unless staff say.
INVITE_VALID_DAYS = env.int("INVITE_VALID_DAYS", default=7)
if not 1 <= INVITE_VALID_DAYS <= 90:
    raise ImproperlyConfigured(f"INVITE_VALID_DAYS must be 1 to 90, got {INVITE_VALID_DAYS}.")
# POSTs per client address to the login pages (ours and admin's) and to sign-up (with an
# invite or without), as a count per period: s, m, h or d, e.g. "20/m" or "10/h". Past it, a
# 429 until the period ends (webapp/accounts/ratelimits.py); axes still locks a username.
LOGIN_RATE_LIMIT = env.str("LOGIN_RATE_LIMIT", default="20/m")
SIGNUP_RATE_LIMIT = env.str("SIGNUP_RATE_LIMIT", default="10/h")
for _name, _value in [("LOGIN_RATE_LIMIT", LOGIN_RATE_LIMIT),
                      ("SIGNUP_RATE_LIMIT", SIGNUP_RATE_LIMIT)]:  # fmt: skip
    if not re.fullmatch(r"[1-9]\d*/\d*[smhd]", _value):
        raise ImproperlyConfigured(
            f"{_name} must be a count per period, such as '20/m' or '10/h' (s, m, h or d), "
            f"not {_value!r}."
        )
