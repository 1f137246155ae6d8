"""What a revoked token (or a deactivated user, or one who left the project) leaves running stops
at once: a sweep submits no more variants and a pipeline starts no more stages, each saying why
(jobs/tokenlimits.py: acting_refusal); its open log websockets close with 4401 and its long
polls end, within a second, with no line printed after the revocation (portal/wsauth.py)."""

import asyncio
import json
import sys
import textwrap
import threading
import time
from dataclasses import replace

import httpx
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from jobs import dependencies
from jobs.models import AttemptState, Job, JobState, PipelineRun
from jobs.submission import submit_job
from jobs.tokenlimits import Acting, TokenEnded, acting_refusal_of
from portal import wsauth
from portal.models import ApiToken, Membership
from tests.factories import api_client, make_attempt, make_job, services_database
from tests.livestack import LiveStack
from tests.test_access import LogSocket

PY = sys.executable


def token_client(user) -> tuple[APIClient, ApiToken]:
    token, raw = ApiToken.issue(user, "agent")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client, token


def end(how: str, client: APIClient, token: ApiToken, user, project) -> None:
    """End what the work acts for, as it ends in use: the API's revoke, a deactivation, a removal."""
    if how == "revoked":
        assert client.delete(f"/api/v1/tokens/{token.pk}/").status_code == 204
    elif how == "deactivated":
        user.is_active = False
        user.save(update_fields=["is_active"])
    else:
        Membership.objects.filter(user=user, project=project).delete()


def finish(job: Job, node, capture) -> None:
    """End the job's attempt as its agent does: the receivers run, and after commit what they queued."""
    with capture(execute=True):
        make_attempt(job, node, AttemptState.RUNNING).finish(AttemptState.SUCCEEDED, exit_code=0)


WHY = {
    "revoked": "the API token 'agent'",
    "deactivated": "owner, who submitted it, was deactivated",
    "left": "owner, who submitted it, is no longer a member of vision",
}


def test_the_refusal_says_what_ended_first_the_token():
    acting = Acting(username="ann", user_active=True, member=True, project="vision")
    assert acting_refusal_of(acting) is None
    token = replace(acting, token="'agent' (hgr_abc…)", token_state="revoked", user_active=False)
    assert acting_refusal_of(token).startswith("the API token 'agent' (hgr_abc…) it was submitted with was revoked")
    assert acting_refusal_of(replace(acting, token_state="deleted")).startswith("the API token it was submitted")
    assert acting_refusal_of(replace(acting, user_active=False)) == "ann, who submitted it, was deactivated"
    assert "no longer a member of vision" in acting_refusal_of(replace(acting, member=False))


# --- sweeps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", WHY)
def test_a_sweep_submits_nothing_for_an_ended_token_or_member_and_says_why(
    how, owner, teammate, project, node, settings, django_capture_on_commit_callbacks
):
    settings.HANGAR_MLFLOW = False
    client, token = token_client(owner)
    body = {
        "name": "lr", "project": "vision", "max_parallel": 1, "objective": {"metric": "loss", "mode": "min"},
        "base": {"command": ["python", "train.py"]}, "grid": {"env.LR": ["0.1", "0.01", "0.001"]},
    }  # fmt: skip
    sweep_id = client.post("/api/v1/sweeps/", body, format="json").json()["id"]
    finish(Job.objects.get(sweep_index=0), node, django_capture_on_commit_callbacks)
    second = Job.objects.get(sweep_index=1)  # the setup: an end lets the next variant in, with the token
    assert second.submitted_with_id == token.pk

    end(how, client, token, owner, project)
    ended_at = timezone.now()
    finish(second, node, django_capture_on_commit_callbacks)

    assert not Job.objects.filter(created_at__gte=ended_at).exists()
    assert sorted(Job.objects.values_list("sweep_index", flat=True)) == [0, 1]
    doc = api_client(teammate).get(f"/api/v1/sweeps/{sweep_id}/").json()
    assert WHY[how] in doc["stopped_reason"], doc
    pending = next(r for r in doc["runs"] if r["index"] == 2)
    assert pending["state"] == "refused" and pending["reason"].startswith("stopped: " + WHY[how])
    assert doc["state"] == "done" and doc["waiting_reason"] == ""


@pytest.mark.parametrize("how", ["revoked", "deleted"])
def test_a_submit_for_a_token_ended_since_its_work_began_is_refused(how, owner, project, node):
    """The last word is the submit's own read of the token (a sweep between its look and its
    submit; another web process that still remembers the token)."""
    token, _ = ApiToken.issue(owner, "agent")
    if how == "revoked":
        ApiToken.objects.get(pk=token.pk).revoke(owner)
    else:
        ApiToken.objects.filter(pk=token.pk).delete()
    owner.api_token_id = token.pk
    with pytest.raises(TokenEnded) as refused:
        submit_job(owner, {"project": "vision", "command": ["true"], "gpus_per_node": 1, "nodes": 1, "max_retries": 0})
    assert f"was {how}" in str(refused.value.detail["token"])
    assert not Job.objects.exists()


def test_a_jobs_many_dependents_look_at_their_submitter_and_token_once(owner, project, node):
    """A job that ends releases its dependents; those of one submitter and token share one look."""
    token, _ = ApiToken.issue(owner, "agent")
    train = make_job(project, owner, name="train", state=JobState.SUCCEEDED)
    needs = [{"job": train.pk, "on": "succeeded"}]
    for index in range(10):
        make_job(project, owner, name=f"eval-{index}", state=JobState.BLOCKED, depends_on=needs, submitted_with=token)
    with CaptureQueriesContext(connection) as queries:
        dependencies.settle_dependents(train.pk, project.pk)
    assert Job.objects.filter(state=JobState.QUEUED).count() == 10  # the setup: each is released
    looks = [q["sql"] for q in queries.captured_queries if 'FROM "portal_apitoken"' in q["sql"]]
    assert len(looks) == 1, looks


# --- pipelines ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["revoked", "left"])
def test_a_pipeline_starts_no_stage_for_an_ended_token_or_member_and_says_why(
    how, owner, teammate, project, node, settings, tmp_path, django_capture_on_commit_callbacks
):
    settings.HANGAR_PIPELINE_ROOT = tmp_path / "pipelines"
    settings.HANGAR_MLFLOW = False
    client, token = token_client(owner)
    stages = {
        "prepare": {"command": ["python", "prep.py"]},
        "train": {"needs": ["prepare"], "command": ["python", "train.py"]},
        "evaluate": {"needs": ["train"], "command": ["python", "eval.py"]},
    }
    response = client.post("/api/v1/pipelines/", {"project": "vision", "stages": stages}, format="json")
    assert response.status_code == 201, response.content
    run = PipelineRun.objects.get(pk=response.json()["id"])
    prepare, train, evaluate = [s.job for s in run.ordered_stages()]
    finish(prepare, node, django_capture_on_commit_callbacks)
    train.refresh_from_db()
    assert train.state == JobState.QUEUED and train.submitted_with_id == token.pk  # the setup: a stage is let in

    end(how, client, token, owner, project)
    finish(train, node, django_capture_on_commit_callbacks)

    evaluate.refresh_from_db()
    assert evaluate.state == JobState.CANCELLED and evaluate.state_reason.startswith("stopped: " + WHY[how])
    assert not evaluate.attempts.exists()
    body = api_client(teammate).get(f"/api/v1/pipelines/{run.pk}/").json()
    assert WHY[how] in body["stopped_reason"] and body["state"] == "cancelled"


# --- open sockets, in process: the news, not the periodic re-check, closes them ------------


@pytest.fixture
def slow_recheck(settings):
    settings.HANGAR_WS_RECHECK_SECONDS = 60  # only the news can close a socket within the tests' second


async def closed_within(socket: LogSocket, seconds: float) -> tuple[int | None, float]:
    began = time.monotonic()
    while (left := seconds - (time.monotonic() - began)) > 0:
        try:
            message = await socket.receive_output(left)
        except TimeoutError:
            break
        if message["type"] == "websocket.close":
            return message.get("code"), time.monotonic() - began
    return None, seconds


def bearer(raw: str) -> list:
    return [(b"authorization", f"Bearer {raw}".encode())]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("how", "path", "code"),
    [
        ("revoked", "logs", 4401),
        ("deleted", "logs", 4401),
        ("deactivated", "logs", 4401),
        ("left", "logs", 4404),
        ("revoked", "fleet", 4401),
    ],
)
def test_an_ended_credential_closes_its_open_sockets_at_once(how, path, code, owner, project, node, slow_recheck):
    job = make_job(project, owner)
    make_attempt(job, node, "running")
    token, raw = ApiToken.issue(owner, "ws")
    url = f"/ws/jobs/{job.pk}/logs/" if path == "logs" else "/ws/fleet/"

    def end_it() -> None:
        if how == "revoked":
            ApiToken.objects.get(pk=token.pk).revoke(owner)
        elif how == "deleted":
            ApiToken.objects.filter(pk=token.pk).delete()
        elif how == "deactivated":
            owner.is_active = False
            owner.save(update_fields=["is_active"])
        else:
            Membership.objects.filter(user=owner, project=project).delete()

    async def scenario():
        socket = LogSocket(url, bearer(raw))
        assert (await socket.connect()) == (True, None)
        await socket.receive_json()  # the first message: the socket works (the setup)
        await database_sync_to_async(end_it)()
        return await closed_within(socket, 1.0)

    closed, took = async_to_sync(scenario)()
    assert closed == code, (closed, took)


def test_a_socket_gone_before_its_watch_began_leaves_nothing_in_the_process_list(owner):
    """A watch cancelled before its first step never runs its own cleanup; the list must not
    keep it (nor its event loop) for the life of the process."""

    class Consumer:
        scope = {"user": owner, "token_id": 987654}

    async def scenario() -> set:
        early, late = wsauth.watch(Consumer()), wsauth.watch(Consumer())
        listed = set(wsauth.local_sockets.by_group.get(wsauth.TOKEN_GROUP.format(987654), ()))
        assert len(listed) == 2  # the setup: both are listed
        early.cancel()  # before its first step
        await asyncio.sleep(0)
        late.cancel()  # while it waits
        await asyncio.gather(early, late, return_exceptions=True)
        return listed

    listed = async_to_sync(scenario)()
    assert not any(listed & members for members in wsauth.local_sockets.by_group.values())


@pytest.mark.django_db(transaction=True)
def test_a_logout_closes_that_sessions_socket_at_once_and_no_other(owner, project, node, slow_recheck):
    job = make_job(project, owner)
    make_attempt(job, node, "running")
    leaving, staying = Client(), Client()
    for browser in (leaving, staying):
        browser.force_login(owner)

    def cookie(browser: Client) -> list:
        return [(b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode())]

    async def scenario():
        first, second = (
            LogSocket(f"/ws/jobs/{job.pk}/logs/", cookie(leaving)),
            LogSocket(f"/ws/jobs/{job.pk}/logs/", cookie(staying)),
        )
        assert (await first.connect()) == (True, None) and (await second.connect()) == (True, None)
        await database_sync_to_async(leaving.logout)()
        return (await closed_within(first, 1.0))[0], (await closed_within(second, 1.0))[0]

    assert async_to_sync(scenario)() == (4401, None)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("how", "status"), [("revoked", 401), ("deactivated", 401), ("left", 404)])
def test_an_ended_credential_ends_its_long_poll_at_once(how, status, owner, project, node):
    job = make_job(project, owner)
    make_attempt(job, node, "running")  # it prints nothing: the poll waits
    client, token = token_client(owner)
    answered: dict = {}

    def poll() -> None:
        try:
            answered["status"] = client.get(f"/api/v1/jobs/{job.pk}/logs/?follow=1&wait=20").status_code
            answered["at"] = time.monotonic()
        finally:
            connection.close()

    waiting = threading.Thread(target=poll)
    waiting.start()
    time.sleep(0.6)
    assert not answered  # it waits (the setup)
    end(how, api_client(owner) if how == "revoked" else client, token, owner, project)
    ended_at = time.monotonic()  # committed
    waiting.join(25)
    assert answered["status"] == status and answered["at"] - ended_at < 1.0, answered


# --- open sockets and long polls, on a real stack ----------------------------------------


@pytest.fixture(scope="module", params=["embedded", "services"])
def stack(request, tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp(f"revocation-{request.param}"))
    quick = {"HANGAR_MLFLOW": "0"}  # no MLflow run to make before the first job's lines
    if request.param == "embedded":
        with LiveStack(env=quick, data_dir=data_dir) as live:
            yield live
        return
    # Two web processes: a revocation made in one must close the sockets of the other.
    services = services_database()
    with services as env, LiveStack(env={**env, **quick, "HANGAR_WEB_WORKERS": "2"}, data_dir=data_dir) as live:
        yield live


def new_token(stack: LiveStack) -> tuple[int, str]:
    response = stack.api("POST", "/api/v1/tokens/", json={"name": "to-revoke"})
    response.raise_for_status()
    return response.json()["id"], response.json()["token"]


def revoke(stack: LiveStack, token_id: int) -> float:
    """Revoke through the API; the time its answer came (the revocation is committed by then)."""
    assert stack.api("DELETE", f"/api/v1/tokens/{token_id}/").status_code == 204
    return time.time()


def ticking_job(stack: LiveStack) -> int:
    """A job that prints the time it prints each line at, 50 lines a second, for a minute."""
    body = textwrap.dedent(
        """
        import time
        for i in range(3000):
            print(f"tick {time.time():.6f}", flush=True)
            time.sleep(0.02)
        """
    )
    return stack.submit([PY, "-c", body], name="ticks")["id"]


class Reader(threading.Thread):
    """One log websocket, read until it closes: every line's print time, and how it closed."""

    def __init__(self, stack: LiveStack, job_id: int, raw: str):
        super().__init__(daemon=True)
        self.url = f"{stack.ws_url}/ws/jobs/{job_id}/logs/"
        self.headers = {"Authorization": f"Bearer {raw}"}
        self.ready = threading.Event()
        self.printed: list[float] = []
        self.code: int | None = None
        self.closed_at: float | None = None
        self.error = ""

    def run(self) -> None:
        try:
            self.read()
        except Exception as exc:  # said by the test's setup assertion
            self.error = repr(exc)

    def read(self) -> None:
        with connect(self.url, additional_headers=self.headers, open_timeout=10) as ws:
            try:
                while True:
                    message = json.loads(ws.recv(timeout=120))
                    for line in message.get("lines", []) if message["type"] == "lines" else []:
                        if line["text"].startswith("tick "):
                            self.printed.append(float(line["text"].split()[1]))
                    if self.printed:
                        self.ready.set()
            except ConnectionClosed as closed:
                self.closed_at = time.time()
                self.code = closed.rcvd.code if closed.rcvd is not None else None
            except TimeoutError:
                self.error = "no message for 120 s"


@pytest.mark.e2e
def test_revoking_a_token_closes_its_log_sockets_at_once_and_no_later_line_arrives(stack):
    job_id = ticking_job(stack)
    token_id, raw = new_token(stack)
    # Several sockets: with two web processes, some are held by the one the revocation is not made in.
    readers = [Reader(stack, job_id, raw) for _ in range(4)]
    for reader in readers:
        reader.start()
    try:
        ready = [r.ready.wait(120) for r in readers]
        assert all(ready), f"the sockets received the job's lines (the setup): {[(r.code, r.error) for r in readers]}"
        revoked_at = revoke(stack, token_id)
        for reader in readers:
            reader.join(15)
        took = [round(r.closed_at - revoked_at, 3) for r in readers if r.closed_at is not None]
        print(f"\nclosed after the revocation's answer (s): {took}")
        assert [r.code for r in readers] == [4401] * 4
        assert all(t <= 1.0 for t in took) and len(took) == 4, took
        late = [p for r in readers for p in r.printed if p >= revoked_at]
        assert not late, f"{len(late)} lines printed after the revocation reached a revoked socket"
    finally:
        stack.api("POST", f"/api/v1/jobs/{job_id}/cancel/", json={})


def quiet_cursor(client: httpx.Client, job_id: int) -> dict:
    """The cursor after the job's last line once it printed 'ready' and then nothing for 2 s."""
    deadline, cursor, seen, quiet_since = time.monotonic() + 120, {"attempt": 0, "seq": 0}, False, time.monotonic()
    while time.monotonic() < deadline:
        query = f"after_attempt={cursor['attempt']}&after_seq={cursor['seq']}"
        page = client.get(f"/api/v1/jobs/{job_id}/logs/?{query}").json()
        if page["lines"]:
            seen = seen or any(line["text"] == "ready" for line in page["lines"])
            cursor, quiet_since = page["cursor"], time.monotonic()
        elif seen and time.monotonic() - quiet_since > 2:
            return cursor
        time.sleep(0.2)
    raise AssertionError("the job printed 'ready', then nothing (the setup)")


@pytest.mark.e2e
def test_revoking_a_token_ends_its_long_poll_at_once(stack):
    job_id = stack.submit([PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"], name="quiet")["id"]
    token_id, raw = new_token(stack)
    client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {raw}"}, timeout=40)
    try:
        cursor = quiet_cursor(client, job_id)
        answered: dict = {}

        def poll() -> None:
            query = f"follow=1&wait=20&after_attempt={cursor['attempt']}&after_seq={cursor['seq']}"
            response = client.get(f"/api/v1/jobs/{job_id}/logs/?{query}")
            answered.update(status=response.status_code, at=time.time(), body=response.text)

        waiting = threading.Thread(target=poll, daemon=True)
        waiting.start()
        time.sleep(1.0)  # it waits: the job prints nothing more
        assert not answered
        revoked_at = revoke(stack, token_id)
        waiting.join(25)
        print(f"\nlong poll ended {answered['at'] - revoked_at:.3f} s after the revocation's answer")
        assert answered["status"] == 401, answered
        assert answered["at"] - revoked_at <= 1.0
    finally:
        client.close()
        stack.api("POST", f"/api/v1/jobs/{job_id}/cancel/", json={})
