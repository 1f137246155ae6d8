"""Projects, members, volumes, tokens and the audit trail through the API, and the tokens page."""

import pytest

from portal.models import ApiToken, AuditEvent, Membership, Role, Volume
from tests.factories import api_client, make_user, token_client


def test_projects_list_mine_with_my_role(roles):
    body = api_client(roles["viewer"]).get("/api/v1/projects/").json()
    assert [(p["slug"], p["role"]) for p in body["results"]] == [("lab", "viewer")]
    assert api_client(roles["viewer"]).get("/api/v1/projects/other/").status_code == 404


@pytest.mark.parametrize("role", Role.values)
def test_every_member_sees_the_member_list(roles, role):
    members = api_client(roles[role]).get("/api/v1/projects/lab/members/").json()["results"]
    assert {m["username"]: m["role"] for m in members}[f"lab-{role}"] == role


@pytest.mark.parametrize(
    ("role", "allowed"), [("viewer", False), ("member", False), ("manager", False), ("admin", True)]
)
def test_only_admins_change_members(roles, role, allowed):
    newcomer = make_user("newcomer")
    client = api_client(roles[role])

    added = client.post("/api/v1/projects/lab/members/", {"username": "newcomer", "role": "viewer"}, format="json")
    changed = client.patch("/api/v1/projects/lab/members/lab-viewer/", {"role": "member"}, format="json")
    removed = client.delete("/api/v1/projects/lab/members/lab-member/")

    expected = (201, 200, 204) if allowed else (403, 403, 403)
    assert (added.status_code, changed.status_code, removed.status_code) == expected
    assert Membership.objects.filter(user=newcomer).exists() == allowed
    if allowed:
        actions = set(AuditEvent.objects.values_list("action", flat=True))
        assert {"member.add", "member.role", "member.remove"} <= actions
        role_change = AuditEvent.objects.get(action="member.role")
        assert role_change.detail == {"user": "lab-viewer", "from": "viewer", "to": "member"}
        assert role_change.actor == roles["admin"]


def test_member_errors_say_what_to_do(roles):
    client = api_client(roles["admin"])
    unknown = client.post("/api/v1/projects/lab/members/", {"username": "ghost", "role": "viewer"}, format="json")
    bad_role = client.patch("/api/v1/projects/lab/members/lab-viewer/", {"role": "boss"}, format="json")
    twice = client.post("/api/v1/projects/lab/members/", {"username": "lab-viewer", "role": "viewer"}, format="json")
    assert "no active user 'ghost'" in unknown.json()["message"]
    assert "use one of viewer, member, manager, admin" in bad_role.json()["message"]
    assert "PATCH their role" in twice.json()["message"]


def test_outsiders_cannot_touch_members(roles):
    client = api_client(roles["outsider"])
    assert client.get("/api/v1/projects/lab/members/").status_code == 404
    assert client.delete("/api/v1/projects/lab/members/lab-member/").status_code == 404


def test_admins_register_volumes(roles):
    body = {"name": "ckpt", "path": "/data/ckpt", "read_role": "member", "write_role": "member"}
    assert api_client(roles["manager"]).post("/api/v1/projects/lab/volumes/", body, format="json").status_code == 403
    created = api_client(roles["admin"]).post("/api/v1/projects/lab/volumes/", body, format="json")
    assert created.status_code == 201 and created.json()["env_name"] == "HANGAR_VOLUME_CKPT"
    relative = api_client(roles["admin"]).post("/api/v1/projects/lab/volumes/", {**body, "path": "x"}, format="json")
    assert "give an absolute path" in relative.json()["message"]
    assert [v["name"] for v in api_client(roles["viewer"]).get("/api/v1/projects/lab/volumes/").json()["results"]] == [
        "ckpt"
    ]
    assert Volume.objects.get().project == roles["lab"]


# --- Tokens ---------------------------------------------------------------------------


def test_a_token_is_shown_once_and_stored_hashed(roles):
    client = api_client(roles["member"])

    created = client.post("/api/v1/tokens/", {"name": "agent", "project": "lab", "read_only": True}, format="json")

    body = created.json()
    assert created.status_code == 201 and body["token"].startswith("hgr_")
    token = ApiToken.objects.get(pk=body["id"])
    assert body["token"] not in (token.digest, token.hint) and token.read_only and token.project == roles["lab"]
    listed = client.get("/api/v1/tokens/").content.decode()
    assert body["token"] not in listed and '"name":"agent"' in listed
    assert AuditEvent.objects.filter(action="token.create", target_id=str(token.pk)).exists()


def test_a_revoked_token_stops_working(roles):
    client = api_client(roles["member"])
    raw = client.post("/api/v1/tokens/", {"name": "agent"}, format="json").json()
    agent = api_client()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {raw['token']}")
    assert agent.get("/api/v1/jobs/").status_code == 200

    assert client.delete(f"/api/v1/tokens/{raw['id']}/").status_code == 204

    assert agent.get("/api/v1/jobs/").status_code == 401
    assert AuditEvent.objects.filter(action="token.revoke").count() == 1


def test_tokens_of_others_are_invisible(roles):
    token, _ = ApiToken.issue(roles["admin"], "theirs")
    client = api_client(roles["member"])
    assert client.delete(f"/api/v1/tokens/{token.pk}/").status_code == 404
    assert "theirs" not in client.get("/api/v1/tokens/").content.decode()


def test_a_token_cannot_be_limited_to_a_foreign_project(roles):
    response = api_client(roles["member"]).post("/api/v1/tokens/", {"name": "x", "project": "other"}, format="json")
    assert response.status_code == 400 and response.json()["errors"][0]["field"] == "project"


def test_a_limited_token_cannot_mint_a_wider_one(roles):
    client = token_client(roles["member"], project=roles["lab"])
    assert client.post("/api/v1/tokens/", {"name": "wide"}, format="json").status_code == 400
    assert client.post("/api/v1/tokens/", {"name": "same", "project": "lab"}, format="json").status_code == 201


def test_a_read_only_token_cannot_mint_tokens(roles):
    client = token_client(roles["member"], read_only=True)
    assert client.post("/api/v1/tokens/", {"name": "x"}, format="json").status_code == 403


def test_the_tokens_page_creates_shows_once_and_revokes(client, roles):
    client.force_login(roles["member"])

    page = client.post("/tokens/", {"name": "laptop", "project": "lab", "read_only": "on"}).content.decode()

    token = ApiToken.objects.get(name="laptop")
    assert token.read_only and token.project == roles["lab"]
    secret = page.split('<pre id="new-token">')[1].split("</pre>")[0]
    assert secret.startswith("hgr_") and ApiToken.authenticate(secret) == token
    assert secret not in client.get("/tokens/").content.decode()

    client.post(f"/tokens/{token.pk}/revoke/")
    assert ApiToken.authenticate(secret) is None


def test_the_tokens_page_revokes_only_your_own(client, roles):
    token, raw = ApiToken.issue(roles["admin"], "theirs")
    client.force_login(roles["member"])
    assert client.post(f"/tokens/{token.pk}/revoke/").status_code == 404
    assert ApiToken.authenticate(raw) == token


# --- Audit ---------------------------------------------------------------------------


def test_the_audit_trail_shows_your_own_actions_and_all_to_site_admins(roles):
    from tests.factories import make_user as mk

    ApiToken.issue(roles["member"], "mine")
    ApiToken.issue(roles["admin"], "theirs")
    root = mk("root", is_superuser=True)

    mine = api_client(roles["member"]).get("/api/v1/audit/").json()["results"]
    everything = api_client(root).get("/api/v1/audit/").json()["results"]

    assert {e["actor"] for e in mine} == {"lab-member"}
    assert {"lab-member", "lab-admin", "root"} <= {e["actor"] for e in everything}


def test_the_last_admin_stays(roles):
    client = api_client(roles["admin"])
    demoted = client.patch("/api/v1/projects/lab/members/lab-admin/", {"role": "member"}, format="json")
    removed = client.delete("/api/v1/projects/lab/members/lab-admin/")
    assert demoted.status_code == removed.status_code == 400
    assert "last admin" in demoted.json()["message"]
    assert Membership.objects.get(user=roles["admin"]).role == Role.ADMIN


def test_a_viewer_gets_403_before_any_validation(roles):
    response = api_client(roles["viewer"]).post("/api/v1/projects/lab/members/", {"bogus": 1}, format="json")
    assert response.status_code == 403


def test_a_token_is_looked_up_once_then_remembered(roles, monkeypatch):
    client = api_client(roles["member"])
    looked_up = []
    authenticate = ApiToken.authenticate
    monkeypatch.setattr(ApiToken, "authenticate", lambda raw: looked_up.append(raw) or authenticate(raw))

    assert [client.get("/api/v1/projects/").status_code for _ in range(3)] == [200, 200, 200]
    assert len(looked_up) == 1


def test_remembered_tokens_are_forgotten_when_revoked_on_the_page_or_their_user_is_deactivated(client, roles):
    token, raw = ApiToken.issue(roles["member"], "laptop")
    agent = api_client()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert agent.get("/api/v1/projects/").status_code == 200
    client.force_login(roles["member"])
    client.post(f"/tokens/{token.pk}/revoke/")
    assert agent.get("/api/v1/projects/").status_code == 401

    other = api_client(roles["viewer"])
    assert other.get("/api/v1/projects/").status_code == 200
    roles["viewer"].is_active = False
    roles["viewer"].save()
    assert other.get("/api/v1/projects/").status_code == 401


def test_each_request_gets_its_own_copy_of_a_remembered_user(roles):
    from portal.auth import recent_token

    _, raw = ApiToken.issue(roles["member"], "agent")
    first, second = recent_token(raw), recent_token(raw)
    first.user.marked = True
    assert first.user == second.user and not hasattr(second.user, "marked")
