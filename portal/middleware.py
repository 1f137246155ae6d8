import logging

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse

from portal.api.shape import error_body

log = logging.getLogger("hangar.web")

# Paths that answer anonymous requests themselves: the API (401 in JSON), the
# login and password reset pages, static files, the favicon and /metrics (its own token or allow-list).
PUBLIC_PREFIXES = ("/api/", "/login/", "/password-reset/", "/static/", "/admin/", "/favicon.ico", "/metrics")


class LoginRequiredMiddleware:
    """Every page needs a logged-in user; the API refuses with 401 on its own."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.user.is_authenticated and not request.path.startswith(PUBLIC_PREFIXES):
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        return self.get_response(request)


class DatabaseUnavailableMiddleware:
    """While the database is down (a restart, a failover) every request answers 503 with
    Retry-After, never a 500 and a traceback: JSON in the API's error shape under /api/,
    a plain page elsewhere. Views' errors come here; errors raised in other middleware
    (loading the session's user) reach the same answer through handler500."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if isinstance(exception, DATABASE_DOWN):
            return database_unavailable(request, exception)
        return None


DATABASE_DOWN = (OperationalError, InterfaceError)
RETRY_AFTER_SECONDS = 5
UNAVAILABLE_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Hangar is briefly unavailable</title></head>
<body><h1>Hangar is briefly unavailable</h1>
<p>Its database cannot be reached right now. Nothing is lost: running jobs keep running.
Reload this page in a few seconds.</p></body></html>
"""


def database_unavailable(request, error: BaseException | None = None) -> HttpResponse:
    # What it was (refused, reset, a pool that gave no connection in HANGAR_DB_POOL_TIMEOUT) is
    # the operator's to tell apart: down is one fix, overloaded another.
    cause = f" ({type(error).__name__}: {str(error).strip()[:300]})" if error is not None else ""
    log.warning("%s %s: database unavailable, answered 503%s", request.method, request.path, cause)
    if request.path.startswith("/api/"):
        errors = [{"field": "", "message": "the database is unavailable; retry shortly"}]
        response: HttpResponse = JsonResponse(error_body("unavailable", errors), status=503)
    else:
        response = HttpResponse(UNAVAILABLE_PAGE, status=503, content_type="text/html; charset=utf-8")
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response
