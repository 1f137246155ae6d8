"""Notifications: who wants to hear about what, and each delivery's log.

A subscription belongs to one user. With a project it covers that project's jobs (and its
budget); without one, the jobs its owner submitted, anywhere. Node events (cordon,
uncordon) need no project: every user sees the fleet. Delivery (jobs/notify.py) is a
Celery task per delivery, sent after the commit of what it reports.
"""

import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from jobs import egress
from portal.models import Project


class Event(models.TextChoices):
    JOB_SUCCEEDED = "job.succeeded", "Job succeeded"
    JOB_FAILED = "job.failed", "Job failed"
    JOB_CANCELLED = "job.cancelled", "Job cancelled"
    NODE_CORDONED = "node.cordoned", "Node cordoned"
    NODE_UNCORDONED = "node.uncordoned", "Node uncordoned"
    BUDGET_THRESHOLD = "budget.threshold", "Budget threshold reached"


JOB_EVENTS = (Event.JOB_SUCCEEDED, Event.JOB_FAILED, Event.JOB_CANCELLED)
NODE_EVENTS = (Event.NODE_CORDONED, Event.NODE_UNCORDONED)


class Channel(models.TextChoices):
    WEBHOOK = "webhook", "Webhook (JSON POST, HMAC-signed)"
    SLACK = "slack", "Slack-compatible webhook"
    EMAIL = "email", "E-mail"


def url_problem(channel: str, url: str, resolve: egress.Resolver = egress.system_resolver) -> str | None:
    """Why a subscription of this channel may not have this URL (said of the field `url`), or
    None; the API and the notifications page both ask."""
    if channel not in (Channel.WEBHOOK, Channel.SLACK):
        return None
    if not url.startswith(("http://", "https://")):
        return f"is required for a {channel} subscription: an http(s) URL"
    return egress.url_problem(url, resolve)


class SubscriptionQuerySet(models.QuerySet):
    def visible_to(self, user) -> "SubscriptionQuerySet":
        """A subscription, its secret and its deliveries are its owner's alone."""
        if user is None or not user.is_authenticated:
            return self.none()
        return self.filter(user=user)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


class Subscription(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="subscriptions")
    project = models.ForeignKey(
        Project,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        help_text="Blank: the jobs you submitted, in any project.",
    )
    events = models.JSONField(default=list, help_text="Event names, e.g. ['job.failed', 'node.cordoned'].")
    channel = models.CharField(max_length=16, choices=Channel.choices, default=Channel.WEBHOOK)
    url = models.URLField(max_length=500, blank=True, help_text="Where webhooks are POSTed.")
    email = models.EmailField(blank=True, help_text="Blank: the owner's address.")
    secret = models.CharField(
        max_length=100, default=new_secret, help_text="Signs webhook bodies (X-Hangar-Signature); never sent."
    )
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    objects = SubscriptionQuerySet.as_manager()

    class Meta:
        ordering = ["user", "pk"]

    def __str__(self) -> str:
        return f"{self.channel} for {self.user} on {', '.join(self.events)}"

    @property
    def target(self) -> str:
        return (self.email or self.user.email) if self.channel == Channel.EMAIL else self.url


class DeliveryState(models.TextChoices):
    PENDING = "pending", "Pending"
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed"

    @property
    def colour(self) -> str:
        return {"pending": "blue", "delivered": "green"}.get(self, "red")


class Delivery(models.Model):
    """One event to one subscription: its payload, its tries and how each went (`log`)."""

    subscription = models.ForeignKey(Subscription, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=32, choices=Event.choices)
    # What the event was about, once per subscription: a repeated signal sends nothing twice.
    key = models.CharField(max_length=200)
    payload = models.JSONField()
    state = models.CharField(max_length=16, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    tries = models.PositiveSmallIntegerField(default=0)
    next_try_at = models.DateTimeField(default=timezone.now)
    log = models.JSONField(default=list, blank=True, help_text="[{at, status, error, ms}] per try.")
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [models.UniqueConstraint(fields=["subscription", "key"], name="one_delivery_per_event")]
        indexes = [models.Index(fields=["state", "next_try_at"])]

    def __str__(self) -> str:
        return f"{self.event} to {self.subscription_id} ({self.state})"

    @property
    def state_colour(self) -> str:
        return DeliveryState(self.state).colour
