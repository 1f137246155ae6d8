"""One permission class decides for every API view (portal.permissions.ApiAccess): a
read-only token changes nothing, node actions included; a project-limited token takes
no fleet-wide action."""

import re

import pytest
from django.urls import get_resolver
from drf_spectacular.generators import SchemaGenerator
from rest_framework.views import APIView

from portal.permissions import ApiAccess
from tests.factories import make_node, make_project, make_user, token_client

UNSAFE = ("post", "put", "patch", "delete")


def unsafe_operations() -> list[tuple[str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return [(method, path) for path, ops in schema["paths"].items() for method in ops if method in UNSAFE]


def concrete(path: str) -> str:
    # Any value that matches the URL pattern: the permission is decided before any lookup.
    return re.sub(r"\{[^}]+\}", "1", path)


@pytest.mark.django_db
def test_a_read_only_token_of_a_staff_admin_is_refused_every_unsafe_operation_of_the_schema():
    admin = make_user("ro-admin", is_staff=True, is_superuser=True)
    make_project("ro", admin=admin)
    make_node("1")
    client = token_client(admin, read_only=True)
    operations = unsafe_operations()
    assert ("post", "/api/v1/nodes/{name}/cordon/") in operations
    assert ("post", "/api/v1/nodes/{name}/fault/") in operations
    allowed = []
    for method, path in operations:
        response = getattr(client, method)(concrete(path), {}, format="json")
        if response.status_code != 403 or "read-only" not in response.json()["message"]:
            allowed.append((method, path, response.status_code))
    assert allowed == []


@pytest.mark.django_db
def test_a_project_limited_token_of_a_staff_user_cannot_cordon_a_node():
    admin = make_user("limited-admin", is_staff=True)
    project = make_project("limited", admin=admin)
    node = make_node("node-l")
    response = token_client(admin, project=project).post(
        f"/api/v1/nodes/{node.name}/cordon/", {"reason": "test"}, format="json"
    )
    assert response.status_code == 403
    assert "limited to one project" in response.json()["message"]
    node.refresh_from_db()
    assert node.state == "ready"


@pytest.mark.django_db
def test_a_full_staff_token_still_cordons():
    admin = make_user("full-admin", is_staff=True)
    node = make_node("node-f")
    response = token_client(admin).post(f"/api/v1/nodes/{node.name}/cordon/", {"reason": "test"}, format="json")
    assert response.status_code == 200, response.content


def api_views():
    def walk(patterns, prefix=""):
        for pattern in patterns:
            if hasattr(pattern, "url_patterns"):
                yield from walk(pattern.url_patterns, prefix + str(pattern.pattern))
            else:
                view = getattr(pattern.callback, "cls", None) or getattr(pattern.callback, "view_class", None)
                if isinstance(view, type) and issubclass(view, APIView) and prefix.startswith("api/v1/"):
                    yield view

    return set(walk(get_resolver().url_patterns))


def test_no_api_view_overrides_the_permission_rule():
    views = {view for view in api_views() if view.__module__.split(".")[0] in ("jobs", "fleet", "portal")}
    assert views
    for view in views:
        assert view.permission_classes == [ApiAccess], view
        assert view.get_permissions is APIView.get_permissions, f"{view.__name__} overrides get_permissions"
