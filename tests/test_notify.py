"""Notifications through real transports: a local HTTP receiver (http.server in a thread) and
Django's mail backend. The notifier's tasks are called as its worker calls them."""

import hashlib
import hmac
import http.server
import json
import socket
import threading
import time
from decimal import Decimal

import pytest
from django.core import mail
from django.utils import timezone

from jobs import notify, settling, tasks
from jobs.models import AttemptState, Budget, CostDaily, Delivery, FailureClass, JobState, Subscription
from portal.models import AuditEvent
from tests.factories import make_attempt, make_job, make_node


class Receiver:
    """A webhook receiver (127.0.0.1 unless told): answers the given statuses in turn (then 200),
    after `delay` s; with `location`, a 307 redirect there instead."""

    def __init__(self, statuses=(), delay: float = 0.0, host: str = "127.0.0.1", port: int = 0, location: str = ""):
        self.statuses, self.delay, self.got = list(statuses), delay, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append((dict(self.headers), body))
                time.sleep(outer.delay)
                self.send_response(307 if location else outer.statuses.pop(0) if outer.statuses else 200)
                if location:
                    self.send_header("Location", location)
                self.end_headers()

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self.server = Server((host, port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(*statuses, delay=0.0, **where):
        made.append(Receiver(statuses, delay, **where))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(autouse=True)
def receivers_allowed(settings):
    """The receivers listen on 127.0.0.1, which webhooks reach only where an operator allowed it."""
    settings.HANGAR_WEBHOOK_ALLOW_NETS = ["127.0.0.1/32"]


def subscribe(user, url, events, project=None, channel="webhook") -> Subscription:
    return Subscription.objects.create(user=user, project=project, events=events, url=url, channel=channel)


def verify(headers: dict, body: bytes, secret: str) -> dict:
    stamp, mac = (part.split("=", 1)[1] for part in headers["X-Hangar-Signature"].split(","))
    expected = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(mac, expected), "bad signature"
    assert abs(time.time() - int(stamp)) < 60
    return json.loads(body)


def fail_job(project, owner, node=None, **fields):
    node = node or make_node()
    job = make_job(project, owner, **fields)
    attempt = make_attempt(job, node, AttemptState.RUNNING, started_at=timezone.now(), running_at=timezone.now())
    return job, attempt


def test_it_posts_a_signed_payload_when_a_job_ends(receiver, project, owner, django_capture_on_commit_callbacks):
    hook = receiver()
    sub = subscribe(owner, hook.url, ["job.failed"], project=project)
    job, attempt = fail_job(project, owner, name="resnet")
    with django_capture_on_commit_callbacks() as announced:
        attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 3", exit_code=3)
    assert announced, "the end is announced after its commit"
    assert tasks.notify_event("attempt", attempt.pk) == 1
    delivery_id = Delivery.objects.get().pk
    assert tasks.deliver(delivery_id) == "delivered"
    ((headers, body),) = hook.got
    payload = verify(headers, body, sub.secret)
    assert headers["X-Hangar-Event"] == "job.failed"
    assert payload["job"]["id"] == job.pk and payload["job"]["state"] == "failed"
    assert payload["job"]["failure_class"] == "user" and payload["job"]["exit_code"] == 3
    assert payload["url"].endswith(f"/jobs/{job.pk}/")
    # Told once: the same end announced again makes no second delivery.
    assert tasks.notify_event("attempt", attempt.pk) == 0


def test_it_posts_a_signed_payload_when_a_node_is_cordoned(receiver, owner, django_capture_on_commit_callbacks):
    hook = receiver()
    sub = subscribe(owner, hook.url, ["node.cordoned", "node.uncordoned"])
    node = make_node("gpu-7")
    with django_capture_on_commit_callbacks() as announced:
        node.auto_cordon("Xid 79 on GPU 3 (fell off the bus)", {"xid": 79, "gpu": 3})
    assert len(announced) >= 1
    audit = AuditEvent.objects.get(action="node.auto_cordon")
    assert tasks.notify_event("node", audit.pk) == 1
    delivery_id = Delivery.objects.get().pk
    assert tasks.deliver(delivery_id) == "delivered"
    payload = verify(*hook.got[0], sub.secret)
    assert payload["event"] == "node.cordoned"
    assert payload["node"]["name"] == "gpu-7" and payload["node"]["automatic"] is True
    assert payload["node"]["evidence"] == {"xid": 79, "gpu": 3}
    assert "Xid 79" in payload["summary"]


def test_it_retries_with_backoff_and_delivers_on_the_third_try(receiver, settings, project, owner):
    settings.HANGAR_WEBHOOK_BACKOFF_SECONDS = 10
    hook = receiver(503, 500)
    subscribe(owner, hook.url, ["job.failed"], project=project)
    job, attempt = fail_job(project, owner)
    attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    tasks.notify_event("attempt", attempt.pk)
    delivery = Delivery.objects.get()
    assert tasks.deliver(delivery.pk) == "pending"
    delivery.refresh_from_db()
    waited = (delivery.next_try_at - timezone.now()).total_seconds()
    assert 8 < waited <= 10, waited
    assert tasks.deliver(delivery.pk) == "pending" and len(hook.got) == 1, "not due yet: no try"
    Delivery.objects.filter(pk=delivery.pk).update(next_try_at=timezone.now())
    assert tasks.deliver(delivery.pk) == "pending"
    delivery.refresh_from_db()
    assert 18 < (delivery.next_try_at - timezone.now()).total_seconds() <= 20, "the wait doubles"
    Delivery.objects.filter(pk=delivery.pk).update(next_try_at=timezone.now())
    assert tasks.deliver(delivery.pk) == "delivered"
    delivery.refresh_from_db()
    assert delivery.tries == 3 and len(hook.got) == 3
    assert [entry["status"] for entry in delivery.log] == [503, 500, 200]


def test_it_gives_up_on_a_refusal_at_once(receiver, project, owner):
    hook = receiver(410)
    subscribe(owner, hook.url, ["job.failed"], project=project)
    job, attempt = fail_job(project, owner)
    attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    tasks.notify_event("attempt", attempt.pk)
    assert tasks.deliver(Delivery.objects.get().pk) == "failed"


def test_a_slow_receiver_never_delays_the_jobs_state_change(
    receiver, project, owner, django_capture_on_commit_callbacks
):
    hook = receiver(delay=2.0)
    subscribe(owner, hook.url, ["job.failed"], project=project)
    job, attempt = fail_job(project, owner)
    started = time.perf_counter()
    with django_capture_on_commit_callbacks(execute=True):  # the real send to the broker, after commit
        attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    assert time.perf_counter() - started < 0.5
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    tasks.notify_event("attempt", attempt.pk)
    started = time.perf_counter()
    assert tasks.deliver(Delivery.objects.get().pk) == "delivered"
    assert time.perf_counter() - started >= 2.0  # the wait was the notifier's, not the job's


def test_secrets_never_appear_in_payloads(receiver, project, owner):
    hook, slack = receiver(), receiver()
    sub = subscribe(owner, hook.url, ["job.failed"], project=project)
    slack_sub = subscribe(owner, slack.url, ["job.failed"], project=project, channel="slack")
    job, attempt = fail_job(project, owner, env={"WANDB_MODE": "plain-env"}, secret_env={"HF_TOKEN": "hf_s3cr3t_v4lue"})
    attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    tasks.notify_event("attempt", attempt.pk)
    for delivery in Delivery.objects.all():
        tasks.deliver(delivery.pk)
    bodies = [body for _, body in hook.got + slack.got]
    assert len(bodies) == 2
    for body in bodies:
        for secret in (b"hf_s3cr3t_v4lue", b"HF_TOKEN", b"plain-env", sub.secret.encode(), slack_sub.secret.encode()):
            assert secret not in body


def test_it_posts_slack_compatible_payloads(receiver, owner):
    hook = receiver()
    subscribe(owner, hook.url, ["node.cordoned"], channel="slack")
    make_node("gpu-3").cordon(owner, "replacing a fan")
    tasks.notify_event("node", AuditEvent.objects.get(action="node.cordon").pk)
    tasks.deliver(Delivery.objects.get().pk)
    body = json.loads(hook.got[0][1])
    assert "gpu-3" in body["text"] and "replacing a fan" in body["text"]
    assert body["blocks"][0]["type"] == "section"


def test_it_sends_email_through_the_mail_backend(project, owner):
    owner.email = "owner@example.org"
    owner.save()
    subscribe(owner, "", ["job.succeeded"], project=project, channel="email")
    job, attempt = fail_job(project, owner, name="bert")
    attempt.finish(AttemptState.SUCCEEDED)
    tasks.notify_event("attempt", attempt.pk)
    assert tasks.deliver(Delivery.objects.get().pk) == "delivered"
    (message,) = mail.outbox
    assert message.to == ["owner@example.org"] and "bert" in message.subject and "succeeded" in message.subject


def test_it_tells_a_budget_threshold_once(project, owner, receiver):
    hook = receiver()
    subscribe(owner, hook.url, ["budget.threshold"], project=project)
    Budget.objects.create(project=project, amount=Decimal("100"), warn_percent=80)
    today = timezone.localdate()
    spend = {"day": today, "project": project, "user": owner, "gpu_type": "H100", "label": "succeeded"}
    CostDaily.objects.create(cost=Decimal("50"), **spend)
    assert notify.fan_out_budget(project.pk) == []
    CostDaily.objects.create(cost=Decimal("35"), **{**spend, "label": "failed"})
    assert len(notify.fan_out_budget(project.pk)) == 1
    assert notify.fan_out_budget(project.pk) == [], "told once per threshold and month"
    CostDaily.objects.create(cost=Decimal("20"), **{**spend, "gpu_type": "A100"})
    (pk,) = notify.fan_out_budget(project.pk)
    assert Delivery.objects.get(pk=pk).payload["budget"]["threshold_percent"] == 100


def test_a_projects_subscription_covers_only_that_project(receiver, project, other_project, owner):
    from portal.models import Membership, Role

    Membership.objects.create(project=other_project, user=owner, role=Role.MEMBER)
    hook = receiver()
    subscribe(owner, hook.url, ["job.failed"], project=other_project)
    job, attempt = fail_job(project, owner)
    attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    assert tasks.notify_event("attempt", attempt.pk) == 0


def test_it_tells_only_the_projects_members(receiver, project, owner, outsider):
    hook = receiver()
    subscribe(outsider, hook.url, ["job.failed"], project=project)  # not a member (any more)
    subscribe(outsider, hook.url, ["job.failed"])  # the jobs the outsider submitted: not this one
    job, attempt = fail_job(project, owner)
    attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    assert tasks.notify_event("attempt", attempt.pk) == 0


def test_a_cancelled_queued_job_is_told(receiver, project, owner, django_capture_on_commit_callbacks):
    hook = receiver()
    subscribe(owner, hook.url, ["job.cancelled"])
    job = make_job(project, owner)
    with django_capture_on_commit_callbacks() as announced:
        job.cancel(owner, "not needed")
    assert announced
    assert tasks.notify_event("job", job.pk) == 1


def test_the_owner_manages_subscriptions_and_reads_the_delivery_log(client, receiver, project, owner, outsider):
    from tests.factories import api_client

    hook = receiver()
    api = api_client(owner)
    made = api.post(
        "/api/v1/subscriptions/",
        {"project": "vision", "events": ["job.failed"], "url": hook.url},
        format="json",
    )
    assert made.status_code == 201, made.content
    assert made.json()["secret"], "shown once, to verify signatures"
    pk = made.json()["id"]
    assert "secret" not in api.get(f"/api/v1/subscriptions/{pk}/").json()
    job, attempt = fail_job(project, owner, name="logged")
    attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    tasks.notify_event("attempt", attempt.pk)
    tasks.deliver(Delivery.objects.get().pk)
    (delivery,) = api.get(f"/api/v1/subscriptions/{pk}/deliveries/").json()
    assert delivery["state"] == "delivered" and delivery["log"][0]["status"] == 200
    client.force_login(owner)
    page = client.get("/notifications/")
    assert page.status_code == 200 and b"logged" in page.content
    # The outsider sees none of it.
    other = api_client(outsider)
    assert other.get(f"/api/v1/subscriptions/{pk}/").status_code == 404
    assert other.get(f"/api/v1/subscriptions/{pk}/deliveries/").status_code == 404
    assert other.get("/api/v1/subscriptions/").json()["results"] == []
    client.force_login(outsider)
    assert b"logged" not in client.get("/notifications/").content
    body = {"project": "vision", "events": ["job.failed"], "url": hook.url}
    refused = other.post("/api/v1/subscriptions/", body, format="json")
    assert refused.status_code == 400 and "vision" in refused.content.decode()


def test_nothing_is_sent_to_the_broker_while_nobody_subscribed(
    receiver, settings, project, owner, django_capture_on_commit_callbacks
):
    if not settings.CELERY_BROKER_URL.startswith("filesystem://"):
        pytest.skip("counts the embedded broker's message files")
    queue = settings.BROKER_DIR / "queue"

    def messages() -> int:
        return len(list(queue.glob("*.hangar.notify.msg")))

    before = messages()
    job, attempt = fail_job(project, owner)
    with django_capture_on_commit_callbacks(execute=True):
        attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
        settling.settle(attempt.pk)  # as the notifier does a moment later: the event is told then
    assert messages() == before
    subscribe(owner, receiver().url, ["job.failed"], project=project)
    job, attempt = fail_job(project, owner, node=attempt.node, name="second")
    with django_capture_on_commit_callbacks(execute=True):
        attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    assert messages() == before  # the event is told once its end is settled, with its cost
    with django_capture_on_commit_callbacks(execute=True):
        settling.settle(attempt.pk)
    assert messages() == before + 1
