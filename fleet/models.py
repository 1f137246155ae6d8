"""Nodes and their GPUs, as their agents report them."""

from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.models import AuditEvent


class NodeState(models.TextChoices):
    READY = "ready", "Ready"
    CORDONED = "cordoned", "Cordoned"
    DRAINING = "draining", "Draining"
    OFFLINE = "offline", "Offline"
    UNHEALTHY = "unhealthy", "Unhealthy"

    @property
    def colour(self) -> str:
        return {"ready": "green", "cordoned": "orange", "draining": "orange", "offline": "grey"}.get(self, "red")


class NodeQuerySet(models.QuerySet):
    def schedulable(self) -> "NodeQuerySet":
        """Ready nodes whose agent was heard from recently: the only ones work goes to."""
        fresh = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS)
        return self.filter(state=NodeState.READY, last_heartbeat_at__gte=fresh)


class Node(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    hostname = models.CharField(max_length=255, blank=True)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.READY)
    gpu_model = models.CharField(max_length=64)
    gpu_count = models.PositiveSmallIntegerField()
    simulated = models.BooleanField(default=False, help_text="GPUs come from the simulator, not NVML.")
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    state_reason = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    state_changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def queue(self) -> str:
        """The Celery queue this node's agent consumes."""
        return f"hangar.node.{self.name}"

    @property
    def state_colour(self) -> str:
        return NodeState(self.state).colour

    def heartbeat(self) -> None:
        """Record that the agent is alive; a node that was offline comes back ready."""
        now = timezone.now()
        Node.objects.filter(pk=self.pk).update(last_heartbeat_at=now)
        came_back = Node.objects.filter(pk=self.pk, state=NodeState.OFFLINE).update(
            state=NodeState.READY, state_reason="agent heartbeat resumed", state_changed_at=now, state_changed_by=None
        )
        if came_back:
            AuditEvent.record(None, "node.online", self, reason="agent heartbeat resumed")

    def cordon(self, by, reason: str) -> bool:
        return self._change_state(NodeState.CORDONED, by, reason, "node.cordon")

    def uncordon(self, by, reason: str) -> bool:
        return self._change_state(NodeState.READY, by, reason, "node.uncordon")

    def _change_state(self, new: str, by, reason: str, action: str) -> bool:
        previous = self.state
        changed = (
            Node.objects.filter(pk=self.pk, state=previous)
            .exclude(state=new)
            .update(state=new, state_reason=reason, state_changed_at=timezone.now(), state_changed_by=by)
        )
        if changed:
            self.state = new
            AuditEvent.record(by, action, self, reason=reason, detail={"previous_state": previous})
        return bool(changed)

    @classmethod
    def mark_silent_offline(cls) -> list["Node"]:
        """Ready nodes whose heartbeat stopped become offline; returns them.

        A cordoned or draining node keeps its state (and its reason): the
        heartbeat that brings an offline node back makes it ready, and that must
        not silently undo a person's cordon.
        """
        cutoff = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS)
        silent = list(cls.objects.filter(state=NodeState.READY, last_heartbeat_at__lt=cutoff))
        gone = []
        for node in silent:
            reason = f"no heartbeat since {node.last_heartbeat_at:%Y-%m-%d %H:%M:%S} UTC"
            if node._change_state(NodeState.OFFLINE, None, reason, "node.offline"):
                gone.append(node)
        return gone


class GPU(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=64)
    model = models.CharField(max_length=64)
    memory_total_mb = models.PositiveIntegerField()
    utilization_pct = models.FloatField(null=True, blank=True)
    memory_used_mb = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    sampled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="one_gpu_per_index")]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index}"
