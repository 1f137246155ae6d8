from django.conf import settings
from django.contrib.auth.views import redirect_to_login

# Paths that answer anonymous requests themselves: the API (401 in JSON), the
# login page, and static files.
PUBLIC_PREFIXES = ("/api/", "/login/", "/static/", "/admin/")


class LoginRequiredMiddleware:
    """Every page needs a logged-in user; the API refuses with 401 on its own."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.user.is_authenticated and not request.path.startswith(PUBLIC_PREFIXES):
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        return self.get_response(request)
