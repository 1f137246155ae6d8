"""The one permission rule of the API: every view's DEFAULT_PERMISSION_CLASSES, none overrides it.

What a request may do is decided here, for every endpoint alike:
- it must be signed in (a session or an API token);
- a read-only token may only read (GET, HEAD, OPTIONS), node actions and fault injection included;
- a view's `operator_actions` (node cordon/drain/uncordon, fault injection) need a staff
  user, and a token limited to one project may not take them: they change the fleet every
  project shares;
- a token's project limit on data is applied by `Project.objects.visible_to`, through which
  every queryset goes (the token authentication puts the limit on the request's user).
"""

from rest_framework import permissions

from portal.models import ApiToken

READ_ONLY = "this API token is read-only; create a token without --read-only to submit, cancel or change things"
OPERATORS_ONLY = "only fleet operators (staff users) may change a node"
PROJECT_LIMITED = (
    "this API token is limited to one project and nodes are shared by every project; "
    "use a token without --project for node actions"
)


class ApiAccess(permissions.BasePermission):
    message = READ_ONLY

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated):
            return False  # DRF answers 401 with the authentication challenge
        token = request.auth if isinstance(request.auth, ApiToken) else None
        if token is not None and token.read_only and request.method not in permissions.SAFE_METHODS:
            self.message = READ_ONLY
            return False
        if getattr(view, "action", None) in getattr(view, "operator_actions", ()):
            if not user.is_staff:
                self.message = OPERATORS_ONLY
                return False
            if token is not None and token.project_id is not None:
                self.message = PROJECT_LIMITED
                return False
        return True
