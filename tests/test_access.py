"""Who may see and touch a job: pages, API and the log websocket."""

import json

import pytest
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from django.utils import timezone

from jobs.models import Job, JobState, LogLine, Severity, Stream
from portal.asgi import application
from portal.models import ApiToken
from tests.factories import api_client, make_attempt, make_job


@pytest.fixture
def job(project, owner):
    return make_job(project, owner)


@pytest.fixture
def teammate_job(project, teammate):
    return make_job(project, teammate, name="teammate-run")


def page_urls(job_id: int) -> list[str]:
    return ["/", "/jobs/", "/jobs/new/", f"/jobs/{job_id}/", f"/jobs/{job_id}/status/"]


API_ENDPOINTS = [
    ("get", "/api/v1/jobs/"),
    ("get", "/api/v1/jobs/{id}/"),
    ("get", "/api/v1/jobs/{id}/logs/"),
    ("post", "/api/v1/jobs/{id}/cancel/"),
    ("get", "/api/v1/nodes/"),
]


def call(client, method: str, url: str, job_id: int):
    return getattr(client, method)(url.format(id=job_id))


# --- Anonymous --------------------------------------------------------------


def test_every_page_sends_an_anonymous_visitor_to_login(client, job):
    for url in page_urls(job.pk):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/login/?next="), url


def test_the_login_page_answers_an_anonymous_visitor(client, db):
    assert client.get("/login/").status_code == 200


@pytest.mark.parametrize(("method", "url"), API_ENDPOINTS)
def test_every_api_endpoint_refuses_an_anonymous_client(job, method, url):
    response = call(api_client(), method, url, job.pk)

    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert set(response.json()) == {"code", "message", "errors"}
    job.refresh_from_db()
    assert job.state == JobState.QUEUED


@pytest.mark.parametrize("header", ["Bearer hgr_not-a-real-token", "Token garbage", "Basic b3duZXI6cHc=", "Bearer"])
def test_a_garbage_token_is_refused(job, header):
    client = api_client()
    client.credentials(HTTP_AUTHORIZATION=header)

    response = client.get("/api/v1/jobs/")

    assert response.status_code == 401
    assert "token" in response.json()["message"].lower()


def test_a_revoked_token_is_refused(owner, job, settings, monkeypatch):
    import time

    token, raw = ApiToken.issue(owner, "laptop")
    client = api_client()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get("/api/v1/jobs/").status_code == 200

    # As another web process revokes it: this one may serve it for HANGAR_API_TOKEN_CACHE_SECONDS more.
    ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    later = time.time() + settings.HANGAR_API_TOKEN_CACHE_SECONDS
    monkeypatch.setattr("django.core.cache.backends.locmem.time.time", lambda: later)  # the cache's clock

    response = client.get("/api/v1/jobs/")
    assert response.status_code == 401
    assert "unknown or revoked" in response.json()["message"]


def test_a_token_of_a_deactivated_user_is_refused(owner, job):
    client = api_client(owner)
    owner.is_active = False
    owner.save(update_fields=["is_active"])

    assert client.get("/api/v1/jobs/").status_code == 401


# --- Members ------------------------------------------------------------------


def test_members_see_the_job_in_the_api(owner, teammate, job):
    for user in (owner, teammate):
        client = api_client(user)
        assert client.get(f"/api/v1/jobs/{job.pk}/").json()["id"] == job.pk
        assert [j["id"] for j in client.get("/api/v1/jobs/").json()["results"]] == [job.pk]


def test_the_job_pages_link_to_the_job_page_not_the_api(client, owner, job):
    client.force_login(owner)

    listing = client.get("/jobs/").content.decode()
    page = client.get(f"/jobs/{job.pk}/")

    assert f'href="/jobs/{job.pk}/"' in listing
    assert "/api/v1/" not in listing
    assert page.status_code == 200
    assert f"/jobs/{job.pk}/cancel/" in page.content.decode()


def test_a_member_cannot_cancel_someone_elses_job(teammate, job):
    response = api_client(teammate).post(f"/api/v1/jobs/{job.pk}/cancel/")

    assert response.status_code == 403
    assert "submitter or a manager" in response.json()["message"]
    job.refresh_from_db()
    assert job.state == JobState.QUEUED


def test_a_member_can_cancel_their_own_job(teammate, teammate_job):
    response = api_client(teammate).post(f"/api/v1/jobs/{teammate_job.pk}/cancel/", {"reason": "typo"}, format="json")

    assert response.status_code == 200
    assert response.json()["state"] == JobState.CANCELLED
    teammate_job.refresh_from_db()
    assert teammate_job.state_reason == "typo"


def test_a_manager_can_cancel_a_members_job(owner, teammate_job):
    response = api_client(owner).post(f"/api/v1/jobs/{teammate_job.pk}/cancel/")

    assert response.status_code == 200
    assert response.json()["state"] == JobState.CANCELLED
    teammate_job.refresh_from_db()
    assert teammate_job.state == JobState.CANCELLED


def test_a_member_cannot_cancel_someone_elses_job_from_the_page(client, teammate, job):
    client.force_login(teammate)

    response = client.post(f"/jobs/{job.pk}/cancel/")

    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == JobState.QUEUED


# --- Outsider -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "url"),
    [("get", "/api/v1/jobs/{id}/"), ("get", "/api/v1/jobs/{id}/logs/"), ("post", "/api/v1/jobs/{id}/cancel/")],
)
def test_an_outsider_gets_404_for_a_job_of_another_project(outsider, other_project, job, method, url):
    response = call(api_client(outsider), method, url, job.pk)

    assert response.status_code == 404
    assert response.json()["code"] == "not_found"
    job.refresh_from_db()
    assert job.state == JobState.QUEUED


def test_an_outsiders_job_list_does_not_show_the_job(outsider, other_project, job):
    own = make_job(other_project, outsider)

    response = api_client(outsider).get("/api/v1/jobs/")

    assert [j["id"] for j in response.json()["results"]] == [own.pk]


@pytest.mark.parametrize("url", ["/jobs/{id}/", "/jobs/{id}/status/"])
def test_an_outsider_gets_404_for_the_job_pages(client, outsider, other_project, job, url):
    client.force_login(outsider)

    assert client.get(url.format(id=job.pk)).status_code == 404


def test_an_outsider_cannot_cancel_from_the_page(client, outsider, other_project, job):
    client.force_login(outsider)

    assert client.post(f"/jobs/{job.pk}/cancel/").status_code == 404
    job.refresh_from_db()
    assert job.state == JobState.QUEUED


def test_an_outsiders_pages_do_not_list_the_job(client, outsider, other_project, job):
    client.force_login(outsider)

    for url in ("/", "/jobs/"):
        assert f"/jobs/{job.pk}/" not in client.get(url).content.decode(), url


# --- The log websocket ----------------------------------------------------------


class LogSocket(ApplicationCommunicator):
    """A websocket client for the ASGI app in-process.

    channels.testing.WebsocketCommunicator does the same, but importing
    channels.testing needs daphne, which Hangar does not install.
    """

    def __init__(self, path: str, headers: list | None = None):
        route, _, query = path.partition("?")
        scope = {"type": "websocket", "path": route, "query_string": query.encode(), "headers": headers or []}
        super().__init__(application, scope)

    async def connect(self, timeout: float = 5) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        response = await self.receive_output(timeout)
        if response["type"] == "websocket.close":
            return False, response.get("code", 1000)
        assert response["type"] == "websocket.accept"
        return True, None

    async def receive_json(self, timeout: float = 5) -> dict:
        response = await self.receive_output(timeout)
        assert response["type"] == "websocket.send", response
        return json.loads(response["text"])

    async def disconnect(self, timeout: float = 5) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": 1000})
        await self.wait(timeout)


def open_socket(path: str, headers: list | None = None, messages: int = 0) -> tuple[bool, int | None, list[dict]]:
    """Connect, read `messages` messages when accepted, disconnect."""

    async def exchange():
        socket = LogSocket(path, headers)
        accepted, code = await socket.connect()
        received = []
        if accepted:
            for _ in range(messages):
                received.append(await socket.receive_json())
            await socket.disconnect()
        return accepted, code, received

    return async_to_sync(exchange)()


def close_code(path: str, headers: list | None = None) -> int | None:
    """The code a refused socket is closed with: accepted first, then closed (portal.wsauth),
    so a client sees the code and not a bare HTTP 403."""

    async def exchange():
        socket = LogSocket(path, headers)
        accepted, code = await socket.connect()
        if not accepted:
            return None  # closed before the accept: a client would only see HTTP 403
        response = await socket.receive_output(5)
        assert response["type"] == "websocket.close", response
        return response.get("code", 1000)

    return async_to_sync(exchange)()


def bearer(user) -> list[tuple[bytes, bytes]]:
    _, raw = ApiToken.issue(user, "ws")
    return [(b"authorization", f"Bearer {raw}".encode())]


@pytest.fixture
def running_job(project, owner, node):
    job = make_job(project, owner)
    attempt = make_attempt(job, node, "running", running_at=timezone.now())
    for seq in range(1, 6):
        LogLine.objects.create(
            job=job,
            attempt=attempt,
            node=node,
            seq=seq,
            rank_seq=seq,
            stream=Stream.STDOUT,
            severity=Severity.INFO,
            ts=timezone.now(),
            text=f"step {seq}",
        )
    return job


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_refuses_an_anonymous_client(running_job):
    assert close_code(f"/ws/jobs/{running_job.pk}/logs/") == 4401


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_refuses_a_garbage_token(running_job):
    assert close_code(f"/ws/jobs/{running_job.pk}/logs/", [(b"authorization", b"Bearer hgr_nope")]) == 4401


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_refuses_an_outsider(running_job, outsider, other_project):
    assert close_code(f"/ws/jobs/{running_job.pk}/logs/", bearer(outsider)) == 4404


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_refuses_a_browser_from_another_site(running_job, owner):
    headers = bearer(owner) + [(b"origin", b"https://evil.example")]

    accepted, _, _ = open_socket(f"/ws/jobs/{running_job.pk}/logs/", headers)

    assert not accepted


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_sends_stored_lines_then_the_state(running_job, owner):
    accepted, _, (lines, state) = open_socket(f"/ws/jobs/{running_job.pk}/logs/", bearer(owner), messages=2)

    attempt = running_job.attempts.get()
    assert accepted
    assert lines["type"] == "lines"
    assert [line["seq"] for line in lines["lines"]] == [1, 2, 3, 4, 5]
    assert lines["lines"][0]["text"] == "step 1"
    assert lines["lines"][0]["stream"] == "stdout"
    assert lines["lines"][0]["node"] == "node-a"
    assert lines["cursor"] == {"attempt": attempt.pk, "seq": 5}
    assert state == {"type": "state", "state": "running", "attempt_state": "running", "exit_code": None, "final": False}


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_resumes_after_the_clients_cursor(running_job, owner):
    attempt = running_job.attempts.get()
    path = f"/ws/jobs/{running_job.pk}/logs/?after_attempt={attempt.pk}&after_seq=2"

    accepted, _, (lines, state) = open_socket(path, bearer(owner), messages=2)

    assert accepted
    assert [line["seq"] for line in lines["lines"]] == [3, 4, 5]
    assert state["type"] == "state"


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_says_final_for_a_finished_job(running_job, owner):
    Job.objects.filter(pk=running_job.pk).update(state=JobState.SUCCEEDED, exit_code=0)
    running_job.attempts.update(state="succeeded", exit_code=0)

    _, _, (lines, state) = open_socket(f"/ws/jobs/{running_job.pk}/logs/", bearer(owner), messages=2)

    assert len(lines["lines"]) == 5
    assert state["final"] is True
    assert state["state"] == "succeeded"
    assert state["exit_code"] == 0


def test_the_project_a_submit_reads_is_the_one_with_role_says(roles):
    """portal.models.project_with_role (a statement compiled once, read by every submit) answers
    as Project.objects.with_role(...).filter(slug=...).first(), for every role, a superuser, an
    anonymous user and a project-limited token, in projects the user is in and is not."""
    from django.contrib.auth.models import AnonymousUser

    from portal.models import Project, Role, project_with_role
    from tests.factories import make_user

    admin = make_user("root-admin")
    admin.is_superuser = True
    limited = make_user("lab-limited")
    roles["lab"].memberships.create(user=limited, role=Role.MEMBER)
    roles["other"].memberships.create(user=limited, role=Role.MEMBER)
    limited.token_project_id = roles["other"].pk  # as the token authentication sets it
    users = [roles[role] for role in Role.values] + [roles["outsider"], admin, limited, AnonymousUser()]
    answers = []
    for user in users:
        for slug in ("lab", "other", "missing"):
            for role in Role.values:
                expected = Project.objects.with_role(user, role).filter(slug=slug).first()
                assert project_with_role(user, slug, role) == expected, (user, slug, role)
                answers.append(expected is not None)
    assert any(answers) and not all(answers)  # both answers were asked for
    assert project_with_role(limited, "lab", Role.MEMBER) is None  # its token is for `other`
    assert project_with_role(roles[Role.VIEWER], "lab", Role.MEMBER) is None
