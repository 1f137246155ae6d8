"""Hangar settings: everything comes from environment variables (see .env.example).

Unset variables give the embedded default: SQLite, a file-system Celery broker
and the data directory `./var`. Setting DATABASE_URL, CELERY_BROKER_URL and
REDIS_URL switches to services mode (PostgreSQL, Redis) with the same code.
"""

import base64
import ipaddress
import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from portal import secretfile

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name) or default


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer; set it to a whole number like {default}")
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below its minimum {minimum}")
    return value


def env_float(name: str, default: float, minimum: float = 0.0) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number; set it to a value like {default}")
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below its minimum {minimum}")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_networks(name: str) -> list[str]:
    """Comma-separated addresses or CIDR networks (default: none), each checked at start."""
    nets = []
    for item in env_list(name, []):
        try:
            nets.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise ImproperlyConfigured(f"{name}: {item!r} is not an address or CIDR network; write e.g. 10.0.0.0/8")
    return nets


# Hangar's own files are its own: every file and folder it creates is private to its user
# (the database, the secret key, spool, broker, MLflow store); jobs run as other uids.
os.umask(0o077)
DATA_DIR = Path(env_str("HANGAR_DATA_DIR", str(BASE_DIR / "var"))).resolve()
DATA_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)


def _secret_key() -> str:
    """Use HANGAR_SECRET_KEY, else a key generated once and kept in the data directory
    (0600; one readable by others is refused: every stored secret's key derives from it)."""
    if key := env_str("HANGAR_SECRET_KEY"):
        return key
    return secretfile.ensure(DATA_DIR / "secret_key", 50, "every stored secret's key derives from it")[0]


SECRET_KEY = _secret_key()
# A key generated into this data directory is this host's alone: other hosts cannot decrypt with it.
SECRET_KEY_GENERATED = not env_str("HANGAR_SECRET_KEY")


def _private_files(root: Path) -> None:
    """Files left readable by others by an older Hangar (the database, the MLflow store) become 0600."""
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False) and entry.stat().st_uid == os.geteuid():
            if entry.stat().st_mode & 0o077:
                os.chmod(entry.path, 0o600)


_private_files(DATA_DIR)
DEBUG = env_bool("HANGAR_DEBUG", False)
ALLOWED_HOSTS = env_list("HANGAR_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("HANGAR_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "axes",
    "csp",
    "portal",
    "fleet",
    "jobs",
    "agent",
]

MIDDLEWARE = [
    "jobs.metrics.RequestMetricsMiddleware",
    "portal.requestid.RequestIdMiddleware",
    "csp.middleware.CSPMiddleware",
    "portal.bodylimits.BodyLimitMiddleware",
    "portal.inputs.InputMiddleware",
    "portal.middleware.DatabaseUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "portal.middleware.LoginRequiredMiddleware",
    # Last, as django-axes asks: it answers a locked-out login attempt (portal/login.py).
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"

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
        },
    },
]

# Each process's own memory: checked API tokens (portal.auth), node sizes and budgeted
# projects for the submit check (portal.remembered) and, without Redis, the API's rate-limit counts.
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "OPTIONS": {"MAX_ENTRIES": 10_000}}}

DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL)}
    if DATABASES["default"]["ENGINE"].endswith("postgresql"):
        # Under ASGI each request runs in a thread of its own, so persistent
        # per-thread connections would be opened anew for every request; a pool
        # shared by the process's threads is what keeps connections warm.
        # A request waits at most HANGAR_DB_POOL_TIMEOUT for a connection: while the
        # database is down that is how long it takes to answer 503.
        DATABASES["default"]["OPTIONS"] = {
            "pool": {
                "min_size": 2,
                "max_size": env_int("HANGAR_DB_POOL_SIZE", 20, minimum=2),
                "timeout": env_float("HANGAR_DB_POOL_TIMEOUT", 5.0, minimum=0.1),
            }
        }
        # With a pool this makes Django pass psycopg_pool's check_connection as the pool's
        # `check`: a connection broken by a database restart is replaced when taken from
        # the pool instead of failing one request each. (Django 5.2 refuses "check" in
        # the pool options themselves: it always passes its own.) portal.postgresql swaps
        # in a check that costs no round trip on a connection with nothing to read.
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
        DATABASES["default"]["ENGINE"] = "portal.postgresql"
        # The statements compiled once (portal/statements.py) are prepared on each connection
        # (portal/postgresql); off for a pooler in transaction mode that cannot keep them.
        DATABASES["default"]["PREPARED_STATEMENTS"] = env_bool("HANGAR_DB_PREPARED", True)
else:
    DATABASES = {
        "default": {
            # Django's SQLite backend, whose writers take turns on a lock file (portal/sqlite/base.py).
            "ENGINE": "portal.sqlite",
            "NAME": DATA_DIR / "hangar.sqlite3",
            "OPTIONS": {
                # Web, scheduler and agent are separate processes writing one file:
                # WAL lets readers run beside the writer, IMMEDIATE takes the write
                # lock at BEGIN so two scheduler passes cannot both read free GPUs.
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # A file, not the in-memory default: tests that run agents' threads against it
            # need WAL and the busy timeout (a shared-cache memory database answers "table is
            # locked" at once instead of waiting).
            "TEST": {"NAME": str(DATA_DIR / "test-hangar.sqlite3")},
        }
    }
EMBEDDED_DATABASE = DATABASES["default"]["ENGINE"] in ("portal.sqlite", "django.db.backends.sqlite3")

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": env_int("HANGAR_PASSWORD_MIN_LENGTH", 10, minimum=8)},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# --- Login throttling (django-axes; portal/login.py) ----------------------------
# After HANGAR_LOGIN_FAILURE_LIMIT wrong passwords for one username from one address,
# that pair is locked out for HANGAR_LOGIN_LOCKOUT_MINUTES (429), even with the right
# password; a successful login resets the count. Every failure is in the audit trail.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("HANGAR_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_float("HANGAR_LOGIN_LOCKOUT_MINUTES", 15.0, minimum=0.1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_HTTP_RESPONSE_CODE = 429
AXES_LOCKOUT_CALLABLE = "portal.login.locked_out"
AXES_VERBOSE = False

# --- Mail (password reset) -------------------------------------------------------
# Embedded default: mails are printed on the web process's console. Set HANGAR_EMAIL_HOST
# (and its port, user, password, TLS) to send them through an SMTP server.
EMAIL_HOST = env_str("HANGAR_EMAIL_HOST")
EMAIL_BACKEND = env_str(
    "HANGAR_EMAIL_BACKEND",
    "django.core.mail.backends.smtp.EmailBackend" if EMAIL_HOST else "django.core.mail.backends.console.EmailBackend",
)
EMAIL_PORT = env_int("HANGAR_EMAIL_PORT", 587, minimum=1)
EMAIL_HOST_USER = env_str("HANGAR_EMAIL_USER")
EMAIL_HOST_PASSWORD = env_str("HANGAR_EMAIL_PASSWORD")
EMAIL_USE_TLS = env_bool("HANGAR_EMAIL_USE_TLS", True)
DEFAULT_FROM_EMAIL = env_str("HANGAR_EMAIL_FROM", "hangar@localhost")
PASSWORD_RESET_TIMEOUT = env_int("HANGAR_PASSWORD_RESET_SECONDS", 3600, minimum=60)

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.auth.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # The one rule for every view (signed in, read-only tokens, operator actions): portal/permissions.py.
    "DEFAULT_PERMISSION_CLASSES": ["portal.permissions.ApiAccess"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    # DRF's JSON parser that refuses NUL, lone surrogates, non-finite or 64-bit-overflowing
    # numbers and deep nesting with a 400 naming the field (portal/inputs.py).
    "DEFAULT_PARSER_CLASSES": ["portal.inputs.JSONParser"],
    "EXCEPTION_HANDLER": "portal.api.errors.exception_handler",
    "DEFAULT_PAGINATION_CLASS": "portal.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_THROTTLE_CLASSES": ["portal.api.throttling.TokenRateThrottle"],
    # Per API token (or per signed-in user, or per address when anonymous),
    # counted in Redis when REDIS_URL is set, else per process: "N/s", "N/min", "N/hour" or "N/day".
    "DEFAULT_THROTTLE_RATES": {"token": env_str("HANGAR_API_RATE_LIMIT", "1200/min")},
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Hangar API",
    "DESCRIPTION": "Jobs, logs, nodes, projects and tokens of a Hangar GPU fleet. "
    "Authenticate with `Authorization: Bearer <token>`; every error has the shape "
    '`{"code", "message", "errors": [{"field", "message"}]}`.',
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI and Redoc are served from the bundled sidecar package: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "ENUM_NAME_OVERRIDES": {
        "RoleEnum": "portal.models.Role.choices",
        "VolumeModeEnum": "portal.models.VolumeMode.choices",
        "ObjectiveModeEnum": "jobs.api.serializers.OBJECTIVE_MODES",
    },
    # Every operation declares the error statuses it may answer (schemathesis checks them all).
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "portal.api.schema.declare_errors"],
}

# How long a web process remembers an API token it has checked (one query less per request):
# a revoked token or deactivated user is refused at once by the process that made the change
# and within this many seconds by the others. 0: look every token up on every request.
HANGAR_API_TOKEN_CACHE_SECONDS = env_float("HANGAR_API_TOKEN_CACHE_SECONDS", 5.0)

# Web server processes `manage.py up` starts (uvicorn, one listening socket each: portal.webserver).
HANGAR_WEB_WORKERS = env_int("HANGAR_WEB_WORKERS", 1, minimum=1)
# Threads per web process that run HTTP requests (portal.sync_http); requests beyond
# them wait their turn. At most the database pool's size: more would wait for a connection.
HANGAR_WEB_THREADS = env_int("HANGAR_WEB_THREADS", 8, minimum=1)
# Requests that wait or stream (portal/capacity.py), per user and per web process; over
# a bound: 429 with Retry-After (a websocket closes with 4429). Long polls per process:
# 0 means half of HANGAR_WEB_THREADS, so short requests always have threads left.
HANGAR_LONG_POLLS_PER_USER = env_int("HANGAR_LONG_POLLS_PER_USER", 2, minimum=1)
HANGAR_LONG_POLLS_PER_PROCESS = env_int("HANGAR_LONG_POLLS_PER_PROCESS", 0, minimum=0)
HANGAR_STREAMS_PER_USER = env_int("HANGAR_STREAMS_PER_USER", 8, minimum=1)
HANGAR_STREAMS_PER_PROCESS = env_int("HANGAR_STREAMS_PER_PROCESS", 200, minimum=1)

# Request bodies (portal/bodylimits.py): larger ones are answered 413 before they are read.
# Requests without credentials (no token, no session cookie) get the smaller limit.
HANGAR_MAX_BODY_BYTES = env_int("HANGAR_MAX_BODY_BYTES", 2 * 1024 * 1024, minimum=1024)
HANGAR_MAX_ANONYMOUS_BODY_BYTES = env_int("HANGAR_MAX_ANONYMOUS_BODY_BYTES", 64 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = HANGAR_MAX_BODY_BYTES
DATA_UPLOAD_MAX_NUMBER_FIELDS = 1000

# --- Production (HTTPS) ------------------------------------------------------
# Behind HTTPS set HANGAR_HTTPS=1: secure cookies, HSTS and a redirect to https,
# which is what `manage.py check --deploy` asks for.
HANGAR_HTTPS = env_bool("HANGAR_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HANGAR_HTTPS
SECURE_SSL_REDIRECT = HANGAR_HTTPS
SECURE_HSTS_SECONDS = env_int("HANGAR_HSTS_SECONDS", 31536000 if HANGAR_HTTPS else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = HANGAR_HTTPS
SECURE_HSTS_PRELOAD = env_bool("HANGAR_HSTS_PRELOAD", HANGAR_HTTPS)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# Content-Security-Policy (django-csp): scripts only from this server's own files, no inline
# script (pages keep their data in <script type="application/json"> blocks and their code
# in static/js), websockets and fetches to this origin only. Inline styles stay allowed:
# Plotly and htmx set them. HANGAR_CSP_REPORT_ONLY=1 reports instead of enforcing.
_CSP = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:", "blob:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "worker-src": ["'self'", "blob:"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}
if env_bool("HANGAR_CSP_REPORT_ONLY", False):
    CONTENT_SECURITY_POLICY_REPORT_ONLY = _CSP
else:
    CONTENT_SECURITY_POLICY = _CSP
if env_bool("HANGAR_BEHIND_PROXY", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SILENCED_SYSTEM_CHECKS = env_list("HANGAR_SILENCED_SYSTEM_CHECKS", [])

# --- Live delivery -------------------------------------------------------
REDIS_URL = env_str("REDIS_URL")
# Keys of Hangar's Channels layer and (with a Redis broker) its Celery queues
# start with this, so several Hangars can share one Redis.
REDIS_PREFIX = env_str("HANGAR_REDIS_PREFIX", "hangar")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # redis-py 8 reads with a 5 s socket timeout by default, which a 5 s BZPOPMIN
            # of channels_redis reaches whenever a job is silent: the websocket then dies.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}], "prefix": REDIS_PREFIX},
        }
    }
else:
    # No layer: agents run in other processes, so websocket consumers poll the
    # stored lines instead (they always read from the database anyway).
    CHANNEL_LAYERS = {}
# How often an open websocket re-checks its token or session (portal/wsauth.py): a revoked
# token, ended session or deactivated user is closed (4401) within this many seconds.
HANGAR_WS_RECHECK_SECONDS = env_float("HANGAR_WS_RECHECK_SECONDS", 3.0, minimum=0.05)
# How often a log websocket re-reads the database when no push hint arrives.
HANGAR_LOG_POLL_SECONDS = env_float("HANGAR_LOG_POLL_SECONDS", 2.0 if REDIS_URL else 0.1, minimum=0.01)

# --- Celery ----------------------------------------------------------------
BROKER_DIR = DATA_DIR / "broker"
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://localhost/")
CELERY_BROKER_TRANSPORT_OPTIONS: dict = {}
if CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "global_keyprefix": f"{REDIS_PREFIX}:",
        # A message taken but not acknowledged this long goes back to the queue. The notifier's
        # are acknowledged early, the scheduler's and the agents' taken without acks
        # (portal/celery.py), so only a message the notifier prefetched can be redelivered;
        # Attempt.begin refuses a rank taken twice either way (the reliability drills set it to seconds).
        "visibility_timeout": env_float("HANGAR_BROKER_VISIBILITY_TIMEOUT", 3600.0, minimum=1.0),
    }
if CELERY_BROKER_URL.startswith("filesystem://"):
    for sub in ("queue", "control", "processed"):
        (BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "control_folder": str(BROKER_DIR / "control"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "store_processed": False,
        # A start is two hops (the wake-up to the scheduler, the attempt to the agent), each waiting
        # half a poll on average: 20 ms keeps an idle start under 100 ms for ~1.5 % more of a core idle.
        "polling_interval": env_float("HANGAR_BROKER_POLL_SECONDS", 0.02, minimum=0.005),
    }
(DATA_DIR / "celery-results").mkdir(exist_ok=True)
CELERY_RESULT_BACKEND = env_str(
    "CELERY_RESULT_BACKEND", REDIS_URL or f"file://{(DATA_DIR / 'celery-results').as_posix()}"
)
CELERY_TASK_IGNORE_RESULT = True

# --- Scheduling and execution ----------------------------------------------
HANGAR_SCHEDULER_INTERVAL = env_float("HANGAR_SCHEDULER_INTERVAL", 2.0, minimum=0.1)
HANGAR_HEARTBEAT_SECONDS = env_float("HANGAR_HEARTBEAT_SECONDS", 5.0, minimum=0.1)
HANGAR_NODE_OFFLINE_SECONDS = env_float("HANGAR_NODE_OFFLINE_SECONDS", 30.0, minimum=1.0)
HANGAR_LEASE_SECONDS = env_float("HANGAR_LEASE_SECONDS", 30.0, minimum=1.0)
HANGAR_START_TIMEOUT_SECONDS = env_float("HANGAR_START_TIMEOUT_SECONDS", 120.0, minimum=1.0)
# An attempt's end is settled (its cost, its MLflow run, its subscribers told) by the notifier
# once it is this old, looking this often (jobs/settling.py): GPUs freed at once go to the next
# jobs first. One no notifier settled is settled by the scheduler's reconciler once OVERDUE old.
HANGAR_SETTLE_DELAY_SECONDS = env_float("HANGAR_SETTLE_DELAY_SECONDS", 1.0, minimum=0.0)
HANGAR_SETTLE_POLL_SECONDS = env_float("HANGAR_SETTLE_POLL_SECONDS", 0.5, minimum=0.05)
HANGAR_SETTLE_OVERDUE_SECONDS = env_float("HANGAR_SETTLE_OVERDUE_SECONDS", 60.0, minimum=1.0)
HANGAR_KILL_GRACE_SECONDS = env_float("HANGAR_KILL_GRACE_SECONDS", 10.0, minimum=0.0)
HANGAR_DEFAULT_MAX_RUNTIME_SECONDS = env_int("HANGAR_DEFAULT_MAX_RUNTIME_SECONDS", 24 * 3600, minimum=1)
HANGAR_MAX_REQUEUES = env_int("HANGAR_MAX_REQUEUES", 5, minimum=0)
HANGAR_LOG_LINE_MAX_BYTES = env_int("HANGAR_LOG_LINE_MAX_BYTES", 16 * 1024, minimum=256)
# Where an agent keeps log lines while the database is unreachable, and how long a
# finished job's writer keeps retrying them before leaving them there.
HANGAR_LOG_SPOOL_DIR = Path(env_str("HANGAR_LOG_SPOOL_DIR", str(DATA_DIR / "log-spool")))
HANGAR_LOG_SPOOL_FLUSH_SECONDS = env_float("HANGAR_LOG_SPOOL_FLUSH_SECONDS", 60.0)
# Log lines older than this are deleted by the scheduler's periodic pass, in batches.
# How many lines the job page's log view keeps (the oldest go; the download has them all).
HANGAR_LOG_VIEW_LINES = env_int("HANGAR_LOG_VIEW_LINES", 200_000, minimum=100)
HANGAR_LOG_RETENTION_DAYS = env_float("HANGAR_LOG_RETENTION_DAYS", 60.0, minimum=0.001)
HANGAR_LOG_RETENTION_INTERVAL_SECONDS = env_float("HANGAR_LOG_RETENTION_INTERVAL_SECONDS", 3600.0, minimum=1.0)
# A filtered page of log lines (PostgreSQL): the planner's plan gets this long; a
# slower one (a filter combination its estimates get wrong) is cancelled and the page
# is read window by window in line order instead, for at most HANGAR_LOG_PAGE_BUDGET_MS.
HANGAR_LOG_QUERY_TIMEOUT_MS = env_int("HANGAR_LOG_QUERY_TIMEOUT_MS", 300, minimum=10)
HANGAR_LOG_PAGE_BUDGET_MS = env_int("HANGAR_LOG_PAGE_BUDGET_MS", 1000, minimum=10)
# Address space of each job process (RLIMIT_AS), in MiB; 0 = no limit. A job past it
# gets an allocation error (its own failure), not the node's OOM killer.
HANGAR_JOB_MEMORY_LIMIT_MB = env_int("HANGAR_JOB_MEMORY_LIMIT_MB", 0, minimum=0)
# Drill-only fault (tests/test_drills_agents.py): the scheduler process exits right
# after committing a placement, before publishing its task. Never set it in production.
HANGAR_FAULT_SCHEDULER_DIE_BEFORE_PUBLISH = env_bool("HANGAR_FAULT_SCHEDULER_DIE_BEFORE_PUBLISH", False)
HANGAR_JOB_WORKDIR = Path(env_str("HANGAR_JOB_WORKDIR", str(DATA_DIR / "jobs")))
# One directory per pipeline run (HANGAR_PIPELINE_DIR in every stage, jobs/pipelines.py). On a
# fleet of several nodes it must be a filesystem every node mounts at the same path.
HANGAR_PIPELINE_ROOT = Path(env_str("HANGAR_PIPELINE_ROOT", str(DATA_DIR / "pipelines")))
# At most this many bytes of data (holes not counted) are copied into a rerun's directory from
# the earlier run's (agent/pipelinecopy.py); a rerun over it fails as the user's, before copying.
HANGAR_PIPELINE_MAX_BYTES = env_int("HANGAR_PIPELINE_MAX_BYTES", 100 * 1024**3, minimum=0)
# Where jobs' checkpoint directories live (ROOT/<job id>). Unset: in each node's job directory,
# so a job requeued onto another host starts without its checkpoint (its log says so). On a
# fleet of several hosts, point it at storage every node mounts at the same path.
HANGAR_CHECKPOINT_ROOT = env_str("HANGAR_CHECKPOINT_ROOT")
# Code snapshots (`hangar submit --code DIR`, jobs/snapshots.py): the most a snapshot's files
# may hold, unpacked (its upload may be a little larger: tar headers), and how many files;
# how much of a dirty tree's `git diff` is kept; how long a snapshot no job has named since
# is kept; and where each agent keeps the snapshots it unpacked (one directory per hash).
HANGAR_SNAPSHOT_MAX_MB = env_int("HANGAR_SNAPSHOT_MAX_MB", 100, minimum=1)
HANGAR_SNAPSHOT_MAX_FILES = env_int("HANGAR_SNAPSHOT_MAX_FILES", 100_000, minimum=1)
HANGAR_SNAPSHOT_DIFF_MAX_BYTES = env_int("HANGAR_SNAPSHOT_DIFF_MAX_BYTES", 512 * 1024, minimum=0)
HANGAR_SNAPSHOT_RETENTION_DAYS = env_float("HANGAR_SNAPSHOT_RETENTION_DAYS", 30.0, minimum=0.001)
HANGAR_SNAPSHOT_CACHE_DIR = Path(env_str("HANGAR_SNAPSHOT_CACHE_DIR", str(DATA_DIR / "snapshot-cache")))
# How many unpacked snapshots an agent keeps; past it the least recently used go (not one
# used in the last 10 minutes, which a rank may still be copying).
HANGAR_SNAPSHOT_CACHE_ENTRIES = env_int("HANGAR_SNAPSHOT_CACHE_ENTRIES", 50, minimum=1)
# Who jobs run as when the agent runs as root: a user name or uid on every node (e.g.
# "hangar-job"). Unset: as the agent's own user (an agent running as root warns).
# The user needs search permission on HANGAR_JOB_WORKDIR's parents and the right to run
# the jobs' programs; the agent makes each job's directory its own (agent/environments.py).
HANGAR_JOB_USER = env_str("HANGAR_JOB_USER")


def env_uid_range(name: str, default: str) -> tuple[int, int] | None:
    """`low-high` (inclusive), or `off` (None: jobs run as the agent's user or HANGAR_JOB_USER)."""
    raw = env_str(name, default).strip()
    if raw.lower() == "off":
        return None
    low, sep, high = raw.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()) or not 0 < int(low) <= int(high) < 2**32 - 1:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a uid range like 200000-299999 (or off)")
    return int(low), int(high)


# Sandboxing (agent/sandbox.py, README "Security model"). An agent running as root runs every
# job as a uid of its own from this range (the same for every attempt; no passwd entry needed)
# and, with HANGAR_SANDBOX on, inside bubblewrap namespaces that show it only its own files.
HANGAR_JOB_UID_RANGE = env_uid_range("HANGAR_JOB_UID_RANGE", "200000-299999")
HANGAR_SANDBOX = env_bool("HANGAR_SANDBOX", True)
# The Python a job's plain `python` runs (its bin/ goes first on the job's PATH); empty: the
# agent's own, whose virtualenv has the MLflow client. Bound into the sandbox wherever it lives.
HANGAR_JOB_PYTHON = env_str("HANGAR_JOB_PYTHON")
# Directories volumes may live in (comma-separated absolute paths); empty: any absolute path.
# A sandboxed job sees none of them but the volumes it mounts, as it mounted them (ro or rw).
HANGAR_VOLUME_ROOTS = [os.path.normpath(p) for p in env_list("HANGAR_VOLUME_ROOTS", [])]
for _root in HANGAR_VOLUME_ROOTS:
    if not _root.startswith("/"):
        raise ImproperlyConfigured(f"HANGAR_VOLUME_ROOTS: {_root!r} is not an absolute path")


# Fernet keys for job secrets, comma-separated: the first encrypts, all decrypt (then a
# key derived from SECRET_KEY). Rotation and limits: jobs/secret_env.py.
def env_fernet_keys(name: str) -> list[str]:
    keys = env_list(name, [])
    for number, key in enumerate(keys, start=1):
        try:
            valid = len(base64.urlsafe_b64decode(key.encode())) == 32
        except ValueError:
            valid = False
        if not valid:
            raise ImproperlyConfigured(
                f"{name}: key {number} is not a Fernet key (32 url-safe base64 bytes); make one with "
                '`python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"`'
            )
    return keys


HANGAR_SECRETS_KEY = env_fernet_keys("HANGAR_SECRETS_KEY")

# --- Queues and capacity -----------------------------------------------------


def env_priority_classes(name: str, default: str) -> dict[str, dict]:
    """`name:rank[:flag+flag]` entries, comma-separated; flags `preempt` (may preempt
    lower classes) and `preemptible` (may be preempted)."""
    classes = {}
    for item in env_list(name, default.split(",")):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1].lstrip("-").isdigit():
            raise ImproperlyConfigured(f"{name}: {item!r} is not name:rank[:flags], e.g. urgent:40:preempt")
        flags = set(parts[2].split("+")) if len(parts) == 3 and parts[2] else set()
        if flags - {"preempt", "preemptible"}:
            raise ImproperlyConfigured(f"{name}: unknown flags {sorted(flags)} in {item!r}; use preempt, preemptible")
        classes[parts[0]] = {
            "rank": int(parts[1]),
            "may_preempt": "preempt" in flags,
            "preemptible": "preemptible" in flags,
        }
    return classes


HANGAR_PRIORITY_CLASSES = env_priority_classes(
    "HANGAR_PRIORITY_CLASSES", "urgent:40:preempt,high:30:preempt,normal:20,low:10:preemptible,scavenger:0:preemptible"
)
HANGAR_PREEMPT_GRACE_SECONDS = env_float("HANGAR_PREEMPT_GRACE_SECONDS", 60.0)
HANGAR_MAX_PREEMPTIONS = env_int("HANGAR_MAX_PREEMPTIONS", 20, minimum=0)
HANGAR_MASTER_PORT_BASE = env_int("HANGAR_MASTER_PORT_BASE", 29500, minimum=1024)
# A Ray job's ports (agent/ray.py): a block of 100 per attempt, attempt id mod 100 (19000-28999 by default).
HANGAR_RAY_PORT_BASE = env_int("HANGAR_RAY_PORT_BASE", 19000, minimum=1024)
# How long rank 0 of a Ray job waits for every node to join its cluster before the driver starts.
HANGAR_RAY_JOIN_SECONDS = env_float("HANGAR_RAY_JOIN_SECONDS", 120.0, minimum=1.0)
HANGAR_DOCKER = env_str("HANGAR_DOCKER", "docker")
# --- Cached Python environments (agent/envcache.py) -------------------------
# Job uids must reach it (search permission on its parents: not under /root on a sandboxing node).
HANGAR_ENV_CACHE_DIR = Path(env_str("HANGAR_ENV_CACHE_DIR", str(DATA_DIR / "envs")))
HANGAR_ENV_CACHE_GB = env_float("HANGAR_ENV_CACHE_GB", 50.0)  # past it, least recently used environments go
HANGAR_ENV_RESOLVE_SECONDS = env_float("HANGAR_ENV_RESOLVE_SECONDS", 86400.0)  # a resolution is reused this long
HANGAR_ENV_BUILD_TIMEOUT_SECONDS = env_float("HANGAR_ENV_BUILD_TIMEOUT_SECONDS", 1800.0, minimum=1.0)
# Interpreters environments are built from (paths); empty: python3 / python3.X on the agent's PATH.
HANGAR_ENV_PYTHONS = env_list("HANGAR_ENV_PYTHONS", [])
HANGAR_UV = env_str("HANGAR_UV")  # the uv binary; empty: the one installed with Hangar (requirements.txt)
# --- Fleet health ----------------------------------------------------------
# Finding kinds (ecc, gpu_lost, nccl, thermal, power; Xids follow the Xid policy
# table) that cordon the node, and those that also stop and requeue its job.
HANGAR_HEALTH_CORDON_KINDS = env_list("HANGAR_HEALTH_CORDON_KINDS", ["ecc", "gpu_lost", "nccl"])
HANGAR_HEALTH_STOP_JOB_KINDS = env_list("HANGAR_HEALTH_STOP_JOB_KINDS", ["ecc", "gpu_lost", "nccl", "xid"])
_HEALTH_KINDS = {"ecc", "gpu_lost", "nccl", "xid", "thermal", "power"}
for _name, _kinds in (
    ("HANGAR_HEALTH_CORDON_KINDS", HANGAR_HEALTH_CORDON_KINDS),
    ("HANGAR_HEALTH_STOP_JOB_KINDS", HANGAR_HEALTH_STOP_JOB_KINDS),
):
    if unknown := set(_kinds) - _HEALTH_KINDS:
        raise ImproperlyConfigured(
            f"{_name} has unknown kinds {sorted(unknown)}; use {', '.join(sorted(_HEALTH_KINDS))}"
        )
# A fault seen only in a job's output cordons its node only when corroborated: the agent's
# re-check fails, the driver reports it, or jobs of this many users (or projects) report it
# there within the window. The same Xid from one GPU's telemetry counts once per storm window.
HANGAR_CORROBORATION_USERS = env_int("HANGAR_CORROBORATION_USERS", 2, minimum=1)
HANGAR_CORROBORATION_WINDOW_SECONDS = env_float("HANGAR_CORROBORATION_WINDOW_SECONDS", 3600.0, minimum=1.0)
HANGAR_XID_STORM_SECONDS = env_float("HANGAR_XID_STORM_SECONDS", 60.0)
# A rank silent this long while others print (or all silent, GPUs idle): hang suspected.
HANGAR_HANG_SECONDS = env_float("HANGAR_HANG_SECONDS", 600.0, minimum=0.1)
HANGAR_PREFLIGHT_MAX_TEMP_C = env_float("HANGAR_PREFLIGHT_MAX_TEMP_C", 85.0)
HANGAR_TELEMETRY_RAW_HOURS = env_float("HANGAR_TELEMETRY_RAW_HOURS", 24.0, minimum=0.01)
HANGAR_FLEET_POLL_SECONDS = env_float("HANGAR_FLEET_POLL_SECONDS", 2.0, minimum=0.1)
HANGAR_RENDEZVOUS_SECONDS = env_float("HANGAR_RENDEZVOUS_SECONDS", 30.0, minimum=0.1)
# A failed rendezvous makes the node the evidence points at a suspect; it is cordoned once this
# many attempts (within the corroboration window) point at it.
HANGAR_RENDEZVOUS_SUSPICIONS = env_int("HANGAR_RENDEZVOUS_SUSPICIONS", 2, minimum=1)
HANGAR_BURN_IN_STRESS_SECONDS = env_float("HANGAR_BURN_IN_STRESS_SECONDS", 3.0, minimum=0.1)
HANGAR_BURN_IN_WAIT_SECONDS = env_float("HANGAR_BURN_IN_WAIT_SECONDS", 60.0, minimum=0.1)
HANGAR_BURN_IN_PYTHON = env_str("HANGAR_BURN_IN_PYTHON")
# --- Experiment tracking (jobs/tracking.py) ---------------------------------
# Embedded default: a local MLflow store in the data directory, no server.
MLFLOW_TRACKING_URI = env_str("MLFLOW_TRACKING_URI", f"sqlite:///{(DATA_DIR / 'mlflow.db').as_posix()}")
HANGAR_MLFLOW = env_bool("HANGAR_MLFLOW", True)
HANGAR_MLFLOW_UI_URL = env_str("HANGAR_MLFLOW_UI_URL").rstrip("/")


def local_web_url() -> str:
    """The web tier as a process on this host reaches it (`manage.py up`'s HANGAR_HOST and HANGAR_PORT)."""
    host = env_str("HANGAR_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{env_int('HANGAR_PORT', 8000, minimum=1)}"


# Jobs reach MLflow only through Hangar's tracking proxy (jobs/trackingproxy.py), at this URL as a
# job's node reaches the web tier: HANGAR_PUBLIC_URL's when set (nodes on other hosts), else this
# host's. Jobs never get MLFLOW_TRACKING_URI's store or server.
HANGAR_TRACKING_PROXY_URL = env_str(
    "HANGAR_TRACKING_PROXY_URL", (env_str("HANGAR_PUBLIC_URL") or local_web_url()).rstrip("/") + "/api/mlflow"
).rstrip("/")
# MLflow's client reports usage to its makers' servers from a thread `import mlflow` starts
# (mlflow/telemetry). Hangar is self-hosted and its processes say nothing outside; an operator
# who wants it sets MLFLOW_DISABLE_TELEMETRY=false. (Jobs do not inherit this environment.)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Jobs on other hosts call the web tier by the proxy's host name: it answers to it, unless the
# operator lists the hosts it answers to.
if "HANGAR_ALLOWED_HOSTS" not in os.environ and "HANGAR_TRACKING_PROXY_URL" in os.environ:
    ALLOWED_HOSTS.append(urlsplit(HANGAR_TRACKING_PROXY_URL).hostname or "localhost")
# Nor does a run's end, written to a tracking server, print a link to it (and read the run for it).
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "hangar": {"handlers": ["console"], "level": env_str("HANGAR_LOG_LEVEL", "INFO")},
    },
}

# --- Operations: metrics and notifications (jobs/metrics.py, jobs/notify.py) --------
# /metrics wants "Authorization: Bearer <token>": HANGAR_METRICS_TOKEN, else a token generated
# into the data directory at first start (`manage.py up` prints it once). HANGAR_METRICS_ALLOW
# (default none) lets these addresses in without it: never a network a job shares (a job of
# network `host` shares the portal host's loopback).
HANGAR_METRICS_TOKEN = env_str("HANGAR_METRICS_TOKEN")
HANGAR_METRICS_TOKEN_FILE = DATA_DIR / "metrics_token"
HANGAR_METRICS_ALLOW = env_networks("HANGAR_METRICS_ALLOW")
# What a process measures itself (API request durations, scheduler passes) is shared with
# the other processes of its machine through prometheus-client's multiprocess files. Set
# before prometheus_client is first imported, which reads it then.
PROMETHEUS_MULTIPROC_DIR = Path(env_str("PROMETHEUS_MULTIPROC_DIR", str(DATA_DIR / "prometheus")))
PROMETHEUS_MULTIPROC_DIR.mkdir(parents=True, exist_ok=True)
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(PROMETHEUS_MULTIPROC_DIR)
# Notifications: e-mail through Django's mail backends (console on the embedded default).
EMAIL_BACKEND = env_str("HANGAR_EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("HANGAR_EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("HANGAR_EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("HANGAR_EMAIL_USER")
EMAIL_HOST_PASSWORD = env_str("HANGAR_EMAIL_PASSWORD")
EMAIL_USE_TLS = env_bool("HANGAR_EMAIL_TLS", False)
DEFAULT_FROM_EMAIL = env_str("HANGAR_EMAIL_FROM", "hangar@localhost")
HANGAR_PUBLIC_URL = env_str("HANGAR_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")
HANGAR_WEBHOOK_TIMEOUT_SECONDS = env_float("HANGAR_WEBHOOK_TIMEOUT_SECONDS", 5.0, minimum=0.1)
HANGAR_WEBHOOK_MAX_TRIES = env_int("HANGAR_WEBHOOK_MAX_TRIES", 5, minimum=1)
# Retry n waits HANGAR_WEBHOOK_BACKOFF_SECONDS * 2**(n-1).
HANGAR_WEBHOOK_BACKOFF_SECONDS = env_float("HANGAR_WEBHOOK_BACKOFF_SECONDS", 10.0, minimum=0.0)
# Webhooks go to public addresses only (jobs/egress.py); these networks are allowed as well.
HANGAR_WEBHOOK_ALLOW_NETS = env_networks("HANGAR_WEBHOOK_ALLOW_NETS")
