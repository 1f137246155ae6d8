"""Notifications: a job's end, a cordon or uncordon, a budget threshold, told to whoever subscribed.

Nothing here runs inside the transaction that changed state: the receivers only ask for one
message after its commit (`announce`), and the notifier process (`manage.py notifier`, a
Celery worker on the `hangar.notify` queue) fans the event out into `Delivery` rows and
delivers each in a task of its own, retried with backoff on transient errors. A slow or
dead receiver therefore never holds a job, a node or a scheduler pass.

Webhook bodies are signed: `X-Hangar-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of
"<t>.<body>" keyed by the subscription's secret>`. Payloads name what happened and link to
it; they never carry a job's environment, its secrets or the subscription's secret, and a
cordon's evidence is what the subscriber's node page would show (`fleet.evidence`). Webhooks
go to public addresses only (`jobs.egress`), checked again at every send.
"""

import hashlib
import hmac
import json
import logging
import time
from datetime import timedelta

import httpx
from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.dispatch import receiver
from django.utils import timezone

from fleet import evidence as fleet_evidence
from fleet import signals as fleet_signals
from fleet.models import Node
from jobs import egress
from jobs.models import Attempt, Budget, Job
from jobs.models.notify import JOB_EVENTS, NODE_EVENTS, Channel, Delivery, DeliveryState, Event, Subscription
from jobs.signals import job_ended
from portal.celery import app
from portal.models import AuditEvent, Project
from portal.remembered import forget_on_change, remembered

log = logging.getLogger("hangar.notify")

QUEUE = "hangar.notify"
# A pending delivery whose next try is this overdue lost its message (a restart): sent again.
OVERDUE_SECONDS = 60


# --- announcing (inside the caller's transaction: only an on_commit) ----------------


ANNOUNCED_BY = {
    "attempt": {*JOB_EVENTS, Event.BUDGET_THRESHOLD},
    "job": {Event.JOB_CANCELLED},
    "node": set(NODE_EVENTS),
}
SUBSCRIBED = "hangar.notify.subscribed-events"
SUBSCRIBED_SECONDS = 5.0


def announce(kind: str, object_id: int) -> None:
    """After the current transaction commits, one message to the notifier (when anyone
    subscribed to what this kind of event can be: no pile of messages nobody wants); never raises."""

    def tell() -> None:
        if ANNOUNCED_BY[kind] & subscribed_events():
            send("hangar.notify_event", kind=kind, object_id=object_id)

    # robust: an error here (the database gone after the commit) is logged, never raised into
    # the code that changed the state.
    transaction.on_commit(tell, robust=True)


def subscribed_events() -> set[str]:
    """The events some active subscription wants; a subscription made in another process counts within 5 s."""

    def read() -> set[str]:
        return {
            e for events in Subscription.objects.filter(active=True).values_list("events", flat=True) for e in events
        }

    return remembered(SUBSCRIBED, read, SUBSCRIBED_SECONDS)


forget_on_change(SUBSCRIBED, Subscription)


def send(task: str, countdown: float | None = None, **kwargs) -> None:
    try:
        app.send_task(task, kwargs=kwargs, queue=QUEUE, countdown=countdown)
    except Exception:  # the broker is down: the sweep (`resend_overdue`) sends pending deliveries later
        log.exception("%s %s not sent", task, kwargs)


@receiver(job_ended)
def _job_ended(sender, job: Job, **kwargs) -> None:
    announce("job", job.pk)


@receiver(fleet_signals.node_state_changed)
def _node_state_changed(sender, node: Node, previous: str, audit: AuditEvent, **kwargs) -> None:
    if audit.action in CORDON_ACTIONS or audit.action.startswith("node.uncordon"):
        announce("node", audit.pk)


CORDON_ACTIONS = ("node.cordon", "node.auto_cordon")


# --- fanning out (in the notifier) ----------------------------------------------------


def fan_out(kind: str, object_id: int) -> list[int]:
    """The deliveries an event makes (one per matching subscription, once); returns their ids."""
    if kind == "attempt":
        attempt = Attempt.objects.filter(pk=object_id).select_related("job").first()
        if attempt is None:
            return []
        return fan_out_job(attempt.job) + fan_out_budget(attempt.job.project_id)
    if kind == "job":
        job = Job.objects.filter(pk=object_id).first()
        return fan_out_job(job) if job is not None else []
    if kind == "node":
        return fan_out_node(object_id)
    raise ValueError(f"unknown notification kind {kind!r}")


def fan_out_job(job: Job) -> list[int]:
    if not job.is_final:
        return []
    event = f"job.{job.state}"
    subs = [s for s in subscribed(event) if covers(s, job)]
    payload = job_payload(job, event)
    return create(subs, event, f"job:{job.pk}:{job.state}", payload, project_id=job.project_id)


def covers(sub: Subscription, job: Job) -> bool:
    """A project's subscription covers its jobs; one without a project, its owner's jobs."""
    if sub.project_id is not None:
        return sub.project_id == job.project_id
    return sub.user_id == job.submitted_by_id


def fan_out_budget(project_id: int) -> list[int]:
    subs = [s for s in subscribed(Event.BUDGET_THRESHOLD) if s.project_id == project_id]
    if not subs:
        return []
    today = timezone.localdate()
    budget = Budget.for_month(project_id, today)
    if budget is None:
        return []
    status = budget.status(today)
    crossed = [pct for pct in sorted({budget.warn_percent, 100}) if status.used_percent >= pct]
    if not crossed:
        return []
    threshold = crossed[-1]
    payload = budget_payload(budget, status, threshold, today)
    key = f"budget:{project_id}:{today:%Y-%m}:{threshold}"
    return create(subs, Event.BUDGET_THRESHOLD, key, payload, project_id=project_id)


def fan_out_node(audit_id: int) -> list[int]:
    audit = AuditEvent.objects.filter(pk=audit_id, target_type="fleet.node").select_related("actor").first()
    node = audit and Node.objects.filter(pk=audit.target_id).first()
    if node is None:
        return []
    event = Event.NODE_UNCORDONED if audit.action.startswith("node.uncordon") else Event.NODE_CORDONED
    payload = node_payload(node, audit, event)
    # Nodes are everyone's, but a cordon's evidence may quote another project's job: each
    # subscriber gets what their node page shows.
    return create(subscribed(event), event, f"node:{audit.pk}", lambda sub: seen_by(sub.user, payload))


def subscribed(event: str) -> list[Subscription]:
    # Few rows, read whole: JSON containment is not portable (SQLite has none).
    active = Subscription.objects.filter(active=True).select_related("user")
    return [s for s in active if event in s.events and s.user.is_active]


def create(subs: list[Subscription], event: str, key: str, payload, project_id: int | None = None) -> list[int]:
    """One delivery per subscription; `payload` is a dict, or a function of the subscription."""
    created = []
    for sub in subs:
        if project_id is not None and not can_see(sub.user, project_id):
            continue  # left the project since subscribing (or submitting)
        body = payload(sub) if callable(payload) else payload
        try:
            with transaction.atomic():
                delivery = Delivery.objects.create(subscription=sub, event=event, key=key, payload=body)
        except IntegrityError:
            continue  # told already (the same event announced twice)
        created.append(delivery.pk)
        transaction.on_commit(lambda pk=delivery.pk: send("hangar.deliver", delivery_id=pk))
    return created


def can_see(user, project_id: int) -> bool:
    return Project.objects.visible_to(user).filter(pk=project_id).exists()


# --- payloads: what happened, never a secret -------------------------------------------


def link(path: str) -> str:
    return f"{settings.HANGAR_PUBLIC_URL}{path}"


def job_payload(job: Job, event: str) -> dict:
    attempt = job.latest_attempt()
    summary = f"Job {job.pk} {job.name!r} {job.state}"
    if job.failure_class:
        summary += f" ({job.failure_class})"
    if job.state_reason:
        summary += f": {job.state_reason[:300]}"
    return {
        "event": event,
        "summary": summary,
        "url": link(f"/jobs/{job.pk}/"),
        "job": {
            "id": job.pk,
            "name": job.name,
            "project": job.project.slug,
            "submitted_by": job.submitted_by.username,
            "state": job.state,
            "failure_class": job.failure_class,
            "exit_code": job.exit_code,
            "reason": job.state_reason[:2000],
            "attempts": job.attempts.count(),
            "node": attempt.node.name if attempt is not None else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        },
    }


def node_payload(node: Node, audit: AuditEvent, event: str) -> dict:
    by = audit.actor.username if audit.actor else "hangar"
    verb = "uncordoned" if event == Event.NODE_UNCORDONED else "cordoned"
    return {
        "event": event,
        "summary": f"Node {node.name} {verb} by {by}: {audit.reason[:300]}",
        "url": link(f"/fleet/nodes/{node.name}/"),
        "node": {
            "name": node.name,
            "state": node.state,
            "gpu_model": node.gpu_model,
            "reason": audit.reason[:2000],
            "by": by,
            "automatic": audit.action == "node.auto_cordon",
            "evidence": audit.detail.get("evidence", {}),
            "at": audit.at.isoformat(),
        },
    }


def seen_by(user, payload: dict) -> dict:
    """A node event's payload with its evidence redacted as the node page redacts it for `user`."""
    evidence = payload["node"]["evidence"]
    if isinstance(evidence, dict):
        (evidence,) = fleet_evidence.redact_cordon_evidence([evidence], user)
    return {**payload, "node": {**payload["node"], "evidence": evidence}}


def budget_payload(budget: Budget, status, threshold: int, day) -> dict:
    slug = budget.project.slug
    return {
        "event": Event.BUDGET_THRESHOLD,
        "summary": f"Project {slug} has spent {status.used_percent:.0f}% of its {day:%Y-%m} budget "
        f"({status.spent:.2f} of {status.amount:.2f})",
        "url": link(f"/costs/?project={slug}"),
        "budget": {
            "project": slug,
            "month": f"{day:%Y-%m}",
            "amount": str(status.amount),
            "spent": str(round(status.spent, 2)),
            "used_percent": round(status.used_percent, 1),
            "threshold_percent": threshold,
            "hard_limit": status.hard_limit,
        },
    }


def slack_body(payload: dict) -> dict:
    """Slack's incoming-webhook shape (also understood by Mattermost, Rocket.Chat, Discord's /slack)."""
    text = f"{payload['summary']} <{payload['url']}|open in Hangar>"
    return {
        "text": text,
        "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}],
        "hangar": payload,
    }


# --- delivering (one try per task) --------------------------------------------------------


class Transient(Exception):
    """Worth another try: a timeout, a refused connection, a 5xx or a 429."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def deliver(delivery_id: int, resolve: egress.Resolver = egress.system_resolver) -> str:
    """Try a pending delivery once; on a transient failure schedule the next try. Returns its state."""
    now = timezone.now()
    claim = now + timedelta(seconds=settings.HANGAR_WEBHOOK_TIMEOUT_SECONDS + OVERDUE_SECONDS)
    # Claimed by moving its next try on: a second message for it (the sweep's) finds nothing due.
    due = Delivery.objects.filter(pk=delivery_id, state=DeliveryState.PENDING, next_try_at__lte=now)
    if not due.update(next_try_at=claim):
        return Delivery.objects.filter(pk=delivery_id).values_list("state", flat=True).first() or "missing"
    delivery = Delivery.objects.select_related("subscription__user").get(pk=delivery_id)
    started = time.perf_counter()
    status, error, retry = None, "", False
    try:
        status = transmit(delivery, resolve)
    except Transient as exc:
        status, error, retry = exc.status, str(exc), True
    except egress.Refused as exc:  # never connected: no remote status, nothing to learn from it
        error = f"{exc}: webhooks go to public addresses only (HANGAR_WEBHOOK_ALLOW_NETS)"
    except Exception as exc:  # a bad address, a refused 4xx: more tries will not help
        error = f"{type(exc).__name__}: {exc}"
    return record_try(delivery, status, error, retry, (time.perf_counter() - started) * 1000)


def record_try(delivery: Delivery, status: int | None, error: str, retry: bool, ms: float) -> str:
    now = timezone.now()
    tries = delivery.tries + 1
    entry = {"at": now.isoformat(), "status": status, "error": error[:500], "ms": round(ms, 1)}
    update = {"tries": tries, "log": [*delivery.log, entry][-20:]}
    if not error:
        update.update(state=DeliveryState.DELIVERED, delivered_at=now)
    elif retry and tries < settings.HANGAR_WEBHOOK_MAX_TRIES:
        wait = settings.HANGAR_WEBHOOK_BACKOFF_SECONDS * 2 ** (tries - 1)
        update.update(next_try_at=now + timedelta(seconds=wait))
        transaction.on_commit(lambda: send("hangar.deliver", countdown=wait, delivery_id=delivery.pk))
    else:
        update.update(state=DeliveryState.FAILED)
    Delivery.objects.filter(pk=delivery.pk).update(**update)
    return update.get("state", DeliveryState.PENDING)


def transmit(delivery: Delivery, resolve: egress.Resolver = egress.system_resolver) -> int | None:
    sub = delivery.subscription
    if sub.channel == Channel.EMAIL:
        return send_email(delivery)
    body_obj = slack_body(delivery.payload) if sub.channel == Channel.SLACK else delivery.payload
    body = json.dumps(body_obj, sort_keys=True, separators=(",", ":")).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "Hangar-Webhook/1",
        "X-Hangar-Event": delivery.event,
        "X-Hangar-Delivery": str(delivery.pk),
        "X-Hangar-Signature": sign(sub.secret, int(time.time()), body),
    }
    try:
        # Resolved and checked here, at each try: the name may point elsewhere since the save.
        target = egress.check(sub.url, resolve)
        status = egress.post(target, body, headers, settings.HANGAR_WEBHOOK_TIMEOUT_SECONDS)
    except egress.Unresolvable as exc:
        raise Transient(str(exc)) from exc
    except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise Transient(f"{type(exc).__name__}: {exc}") from exc
    if status >= 500 or status == 429:
        raise Transient(f"HTTP {status}", status)
    if status >= 400:
        raise ValueError(f"HTTP {status}: the receiver refused it")
    if status >= 300:
        raise ValueError(f"HTTP {status}: redirects are not followed; subscribe to the URL it points to")
    return status


def send_email(delivery: Delivery) -> None:
    payload = delivery.payload
    target = delivery.subscription.target
    if not target:
        raise ValueError("no e-mail address: set one on the subscription or the user")
    text = f"{payload['summary']}\n\n{payload['url']}\n\n-- Hangar ({delivery.event})\n"
    try:
        send_mail(f"[Hangar] {payload['summary'][:150]}", text, settings.DEFAULT_FROM_EMAIL, [target])
    except OSError as exc:  # the mail server is down or refused the connection
        raise Transient(f"{type(exc).__name__}: {exc}") from exc
    return None


def resend_overdue() -> int:
    """Pending deliveries whose message was lost (a broker or notifier restart) are sent again."""
    cutoff = timezone.now() - timedelta(seconds=OVERDUE_SECONDS)
    ids = list(
        Delivery.objects.filter(state=DeliveryState.PENDING, next_try_at__lt=cutoff).values_list("pk", flat=True)
    )
    for pk in ids[:1000]:
        send("hangar.deliver", delivery_id=pk)
    return len(ids)


__all__ = ["JOB_EVENTS", "announce", "deliver", "fan_out", "resend_overdue", "sign"]
