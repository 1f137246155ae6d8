"""Nodes and their GPUs, as their agents report them."""

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, models, transaction
from django.utils import timezone

from fleet import health, signals
from fleet.gpus import FAULT_KINDS, POWER_REASONS, THERMAL_REASONS, GpuSample
from portal import wakeup
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


# States set by the system, not a person: a silent agent turns them offline.
OFFLINE_FROM = (NodeState.READY, NodeState.UNHEALTHY)


class NodeQuerySet(models.QuerySet):
    def schedulable(self, heard_since: datetime | None = None) -> "NodeQuerySet":
        """Ready nodes whose agent was heard from recently (since `heard_since`, by default
        heard_since_now()): the only ones work goes to."""
        return self.filter(state=NodeState.READY, last_heartbeat_at__gte=heard_since or heard_since_now())


def heard_since_now() -> datetime:
    """How recently a node's agent must have been heard from for work to go to it."""
    return timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS)


NODE_QUEUE_PREFIX = "hangar.node."  # + the node's name: the queue its agent consumes


class Node(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    hostname = models.CharField(max_length=255, blank=True)
    # What other nodes reach this one at (MASTER_ADDR when it runs rank 0): `manage.py agent
    # --advertise-address`, else the address of the interface that reaches the database.
    address = models.CharField(max_length=255, blank=True, help_text="The address other nodes reach this one at.")
    network_interface = models.CharField(
        max_length=64,
        blank=True,
        help_text="The interface its ranks' gloo/NCCL traffic uses.",
    )
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
    auto_cordoned = models.BooleanField(
        default=False, help_text="Cordoned by a health check or event: uncordoning runs a burn-in first."
    )
    # What its agent reported at start (agent/sandbox.py): sandbox, uid (own uid, no bubblewrap) or none.
    isolation = models.CharField(
        max_length=16, default="none", help_text="sandbox, uid or none, as its agent reported."
    )
    isolation_reason = models.TextField(blank=True, help_text="Why isolation is less than a sandbox.")
    # The Python a job's plain `python` runs, as its agent ran it as a job uid at start (agent/sandbox.py).
    job_python = models.CharField(max_length=500, blank=True, help_text="A job's `python` here, as checked.")
    job_python_problem = models.TextField(blank=True, help_text="Why a job's uid cannot run it, and the fix.")
    refused_environments = models.JSONField(
        default=dict,
        blank=True,
        help_text="Environments it was asked to run whose Python a job uid cannot run here: why.",
    )

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def queue(self) -> str:
        """The Celery queue this node's agent consumes."""
        return f"{NODE_QUEUE_PREFIX}{self.name}"

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
            wakeup.request_pass(queue_changed=False)

    def cordon(self, by, reason: str, evidence: dict | None = None) -> bool:
        """Take the node out of scheduling (from ready, draining or offline)."""
        return self._change_state(NodeState.CORDONED, by, reason, "node.cordon", evidence)

    def auto_cordon(self, reason: str, evidence: dict | None = None) -> bool:
        """A health check or event cordons the node; uncordoning it will need a burn-in,
        also when a person had cordoned it already."""
        if self._change_state(NodeState.CORDONED, None, reason, "node.auto_cordon", evidence, auto=True):
            return True
        marked = Node.objects.filter(pk=self.pk, state=NodeState.CORDONED, auto_cordoned=False).update(
            auto_cordoned=True
        )
        if marked:
            self.auto_cordoned = True
            AuditEvent.record(None, "node.auto_cordon", self, reason=reason, detail={"evidence": evidence or {}})
        return False

    def mark_unhealthy(self, reason: str, evidence: dict | None = None) -> bool:
        """The agent is alive but cannot use all the node's GPUs (see `health.unhealthy_reason`).
        Only a ready (or offline, whose agent is back) node becomes unhealthy: a cordon or drain
        already keeps work off, and its reason (and burn-in duty) must not be replaced by a
        condition that may clear by itself."""
        ready = {"state__in": [NodeState.READY, NodeState.OFFLINE]}
        return self._change_state(NodeState.UNHEALTHY, None, reason, "node.unhealthy", evidence, only_if=ready)

    def mark_healthy(self, reason: str) -> bool:
        """The condition that made the node unhealthy cleared: back to ready. Only from unhealthy,
        which is only ever set automatically; an operator's later cordon is kept."""
        only = {"state__in": [NodeState.UNHEALTHY]}
        return self._change_state(NodeState.READY, None, reason, "node.healthy", only_if=only)

    def drain(self, by, reason: str) -> bool:
        """No new work; what runs there finishes."""
        return self._change_state(NodeState.DRAINING, by, reason, "node.drain")

    def uncordon(self, by, reason: str, action: str = "node.uncordon", evidence: dict | None = None) -> bool:
        return self._change_state(NodeState.READY, by, reason, action, evidence)

    def _change_state(
        self,
        new: str,
        by,
        reason: str,
        action: str,
        evidence: dict | None = None,
        auto: bool = False,
        only_if: dict | None = None,
    ) -> bool:
        """A conditional update from the state read now; `only_if` adds conditions checked in the same UPDATE."""
        row = Node.objects.filter(pk=self.pk).values_list("state", "auto_cordoned").first()
        if row is None or row[0] == new:
            return False
        previous, was_auto = row
        # A health fault's cordon outlives a drain or an offline spell: only a return to
        # ready (after the burn-in or an audited override) clears it.
        auto = auto or (was_auto and new != NodeState.READY)
        changed = Node.objects.filter(pk=self.pk, state=previous, **(only_if or {})).update(
            state=new, state_reason=reason, state_changed_at=timezone.now(), state_changed_by=by, auto_cordoned=auto
        )
        if changed:
            self.state, self.state_reason, self.auto_cordoned = new, reason, auto
            detail = {"previous_state": previous, **({"evidence": evidence} if evidence else {})}
            audit = AuditEvent.record(by, action, self, reason=reason, detail=detail)
            signals.node_state_changed.send(sender=Node, node=self, previous=previous, audit=audit)
            wakeup.request_pass(queue_changed=False)  # capacity changed: place (or stop placing) work at once
        return bool(changed)

    def state_history(self) -> models.QuerySet:
        return AuditEvent.objects.filter(target_type="fleet.node", target_id=str(self.pk)).select_related("actor")

    @classmethod
    def mark_silent_offline(cls) -> list["Node"]:
        """Ready (or unhealthy) nodes whose heartbeat stopped go offline; their attempts are lost (infra), requeued.

        A cordoned or draining node keeps its state (and its reason): the
        heartbeat that brings an offline node back makes it ready, and that must
        not silently undo a person's cordon. Attempts there end by their lease.
        """
        cutoff = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS)
        silent = list(cls.objects.filter(state__in=OFFLINE_FROM, last_heartbeat_at__lt=cutoff))
        gone = []
        for node in silent:
            reason = f"no heartbeat since {node.last_heartbeat_at:%Y-%m-%d %H:%M:%S} UTC"
            # Re-checked in the UPDATE: a heartbeat that lands after the read keeps the node ready.
            stale = {"last_heartbeat_at__lt": cutoff}
            if node._change_state(NodeState.OFFLINE, None, reason, "node.offline", only_if=stale):
                signals.node_offline.send(sender=cls, node=node, reason=reason)
                HealthEvent.objects.create(
                    node=node, kind=health.Kind.HEARTBEAT, severity="critical", message=reason, action="offline"
                )
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
    sm_clock_mhz = models.FloatField(null=True, blank=True)
    throttle_reasons = models.JSONField(default=list, blank=True)
    ecc_uncorrected_volatile = models.PositiveIntegerField(default=0)
    ecc_uncorrected_aggregate = models.PositiveIntegerField(default=0)
    retired_pages_pending = models.BooleanField(default=False)
    remapped_rows_pending = models.BooleanField(default=False)
    lost = models.BooleanField(default=False, help_text="Fell off the bus: the driver no longer answers for it.")
    last_xid = models.PositiveIntegerField(null=True, blank=True)
    last_xid_at = models.DateTimeField(null=True, blank=True)
    sampled_at = models.DateTimeField(null=True, blank=True)

    TELEMETRY_FIELDS = [
        "utilization_pct",
        "memory_used_mb",
        "temperature_c",
        "power_w",
        "sm_clock_mhz",
        "throttle_reasons",
        "ecc_uncorrected_volatile",
        "ecc_uncorrected_aggregate",
        "retired_pages_pending",
        "remapped_rows_pending",
        "lost",
        "sampled_at",
    ]

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="one_gpu_per_index")]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index}"

    @classmethod
    def save_telemetry(cls, gpus) -> None:
        """Write the latest telemetry of many GPUs in one statement batch. (bulk_update builds a CASE
        expression per field and row: at a thousand nodes its CPU cost, not the database, was the limit.)"""
        names = [*cls.TELEMETRY_FIELDS, "last_xid", "last_xid_at"]
        fields = [cls._meta.get_field(name) for name in names]
        assignments = ", ".join(f"{connection.ops.quote_name(f.column)} = %s" for f in fields)
        sql = f"UPDATE {connection.ops.quote_name(cls._meta.db_table)} SET {assignments} WHERE id = %s"
        params = [[f.get_db_prep_save(getattr(gpu, f.attname), connection) for f in fields] + [gpu.pk] for gpu in gpus]
        with connection.cursor() as cursor:
            cursor.executemany(sql, params)

    @property
    def errors(self) -> list[str]:
        """Short badges for the fleet page."""
        out = []
        if self.lost:
            out.append("lost")
        if self.ecc_uncorrected_volatile:
            out.append(f"ECC {self.ecc_uncorrected_volatile}")
        if self.retired_pages_pending or self.remapped_rows_pending:
            out.append("pages pending")
        if self.last_xid is not None:
            out.append(f"Xid {self.last_xid}")
        if set(self.throttle_reasons) & THERMAL_REASONS:
            out.append("thermal")
        if set(self.throttle_reasons) & POWER_REASONS:
            out.append("power")
        return out

    def apply(self, sample: GpuSample, at) -> None:
        """Copy a provider's sample onto this row (the latest telemetry). A lost GPU keeps its last values."""
        self.lost, self.sampled_at = sample.lost, at
        if not sample.lost:
            for name in self.TELEMETRY_FIELDS[:-2]:
                setattr(self, name, getattr(sample, name))
            self.throttle_reasons = list(sample.throttle_reasons)
        if sample.xids:
            self.last_xid, self.last_xid_at = sample.xids[-1], at


class TelemetryQuerySet(models.QuerySet):
    def bulk_create(self, objs, *args, **kwargs):
        objs = list(objs)
        for row in objs:
            row.epoch_minute = int(row.at.timestamp() // 60)
        return super().bulk_create(objs, *args, **kwargs)


class TelemetrySample(models.Model):
    """One GPU's telemetry at one time. Raw samples (`period_s`=0) older than
    HANGAR_TELEMETRY_RAW_HOURS are folded into one-minute averages (`period_s`=60)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="samples")
    gpu_index = models.PositiveSmallIntegerField()
    at = models.DateTimeField()
    # Whole minutes since the epoch: charts average by it (an integer GROUP BY is fast on every
    # database; truncating timestamps per row is not, on SQLite).
    epoch_minute = models.PositiveIntegerField(default=0)
    period_s = models.PositiveIntegerField(default=0)
    utilization_pct = models.FloatField(null=True)
    memory_used_mb = models.FloatField(null=True)
    temperature_c = models.FloatField(null=True)
    power_w = models.FloatField(null=True)
    sm_clock_mhz = models.FloatField(null=True)
    thermal_throttle_s = models.FloatField(default=0, help_text="Seconds throttled for heat in this sample's period.")
    power_throttle_s = models.FloatField(default=0, help_text="Seconds throttled for power in this sample's period.")
    ecc_uncorrected = models.PositiveIntegerField(default=0)

    VALUES = ["utilization_pct", "memory_used_mb", "temperature_c", "power_w", "sm_clock_mhz"]

    objects = TelemetryQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["node", "at"])]

    def save(self, *args, **kwargs):
        self.epoch_minute = int(self.at.timestamp() // 60)
        super().save(*args, **kwargs)

    @classmethod
    def from_sample(cls, node: Node, sample: GpuSample, at, interval_s: float) -> "TelemetrySample":
        return cls(
            node=node,
            gpu_index=sample.index,
            at=at,
            epoch_minute=int(at.timestamp() // 60),
            utilization_pct=sample.utilization_pct,
            memory_used_mb=sample.memory_used_mb,
            temperature_c=sample.temperature_c,
            power_w=sample.power_w,
            sm_clock_mhz=sample.sm_clock_mhz,
            thermal_throttle_s=interval_s if sample.thermal_throttled else 0.0,
            power_throttle_s=interval_s if sample.power_throttled else 0.0,
            ecc_uncorrected=sample.ecc_uncorrected_volatile,
        )

    @classmethod
    def downsample(cls, node: Node, older_than, bucket_s: int = 60) -> int:
        """Fold raw samples older than `older_than` into `bucket_s` averages; returns raw rows removed."""
        # Whole buckets only: a bucket split by the cutoff would be folded twice, into two rows.
        older_than = datetime.fromtimestamp(int(older_than.timestamp()) // bucket_s * bucket_s, tz=UTC)
        raw = list(
            cls.objects.filter(node=node, period_s=0, at__lt=older_than)
            .order_by("at")
            .values("pk", "gpu_index", "at", "thermal_throttle_s", "power_throttle_s", "ecc_uncorrected", *cls.VALUES)
        )
        if not raw:
            return 0
        buckets: dict[tuple[int, int], list[dict]] = {}
        for row in raw:
            key = (row["gpu_index"], int(row["at"].timestamp()) // bucket_s)
            buckets.setdefault(key, []).append(row)
        folded = [cls._fold(node, gpu, start * bucket_s, bucket_s, rows) for (gpu, start), rows in buckets.items()]
        with transaction.atomic():
            cls.objects.bulk_create(folded, batch_size=1000)
            ids = [row["pk"] for row in raw]
            for i in range(0, len(ids), 900):
                cls.objects.filter(pk__in=ids[i : i + 900]).delete()
        return len(raw)

    @classmethod
    def _fold(cls, node: Node, gpu: int, start: int, bucket_s: int, rows: list[dict]) -> "TelemetrySample":
        def mean(name):
            values = [r[name] for r in rows if r[name] is not None]
            return sum(values) / len(values) if values else None

        return cls(
            node=node,
            gpu_index=gpu,
            at=datetime.fromtimestamp(start, tz=UTC),
            epoch_minute=start // 60,
            period_s=bucket_s,
            thermal_throttle_s=sum(r["thermal_throttle_s"] for r in rows),
            power_throttle_s=sum(r["power_throttle_s"] for r in rows),
            ecc_uncorrected=max(r["ecc_uncorrected"] for r in rows),
            **{name: mean(name) for name in cls.VALUES},
        )


class HealthCheck(models.Model):
    """One preflight or burn-in check on a node, with how long it took and what it saw."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="checks")
    attempt = models.ForeignKey("jobs.Attempt", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    suite = models.CharField(max_length=16, default="preflight")  # preflight | burn-in
    name = models.CharField(max_length=32)
    passed = models.BooleanField()
    duration_ms = models.FloatField()
    evidence = models.TextField(blank=True)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["node", "at"])]


class HealthEvent(models.Model):
    """Something seen on a node (telemetry, a job's output, a lost heartbeat) and what was done about it."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="events")
    gpu_index = models.PositiveSmallIntegerField(null=True, blank=True)
    attempt = models.ForeignKey("jobs.Attempt", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    kind = models.CharField(max_length=16)
    severity = models.CharField(max_length=8)
    xid = models.PositiveIntegerField(null=True, blank=True)
    message = models.TextField()
    evidence = models.JSONField(default=dict, blank=True)
    action = models.CharField(max_length=64, blank=True, help_text="What the policy did: cordoned, job stopped, ...")
    source = models.CharField(
        max_length=16,
        default=health.Source.TELEMETRY,
        help_text="telemetry (the driver) or output (a job's, untrusted)",
    )
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["node", "at"])]

    JOB_STOPPED = "job stopped"  # in `action` when the policy stopped the jobs the event hit

    @property
    def severity_colour(self) -> str:
        return {"critical": "red", "warning": "orange"}.get(self.severity, "grey")

    @classmethod
    def stopping_fault(cls, attempt_id: int, node_id: int, gpus: list[int]) -> "HealthEvent | None":
        """A health event recorded since the attempt started whose policy stops the jobs it hits,
        on this rank's node and GPUs (or on the attempt itself, from its output). A process that
        exits non-zero before the agent's stop reaches it most likely died of that fault."""
        attempts = cls._meta.get_field("attempt").related_model  # jobs.Attempt, by its string key
        started = attempts.objects.filter(pk=attempt_id).values_list("started_at", flat=True).first()
        if started is None:
            return None
        own = models.Q(attempt_id=attempt_id)
        on_its_gpus = models.Q(attempt__isnull=True) & (models.Q(gpu_index__isnull=True) | models.Q(gpu_index__in=gpus))
        return (
            cls.objects.filter(own | on_its_gpus, node_id=node_id, at__gte=started, action__contains=cls.JOB_STOPPED)
            .exclude(action__contains=cls.SUSPECTED)  # a line the job printed itself does not make its exit infra
            .order_by("at")
            .first()
        )

    SUSPECTED = "suspected"  # in `action`: seen only in a job's output, not corroborated

    @classmethod
    def record(
        cls, node: Node, finding: health.Finding, attempt=None, recheck: tuple[bool, list[str]] | None = None
    ) -> tuple["HealthEvent", health.Decision]:
        """Store the finding and apply the policy to the node: cordon it when the decision says so.
        A finding from a job's output is weighed against the corroborating evidence (`fleet.corroboration`);
        `recheck` is the agent's re-check of the node's GPUs (ran, failures), when one ran."""
        from fleet import corroboration as corroborating

        if (repeat := corroborating.storm_repeat(node, finding)) is not None:
            return repeat, health.Decision(False, False, "the same Xid within the storm window: counted once")
        rule = XidPolicy.rule_for(finding.xid) if finding.xid is not None else None
        recent = 0
        if rule is not None and rule.action == health.Action.TREND:
            since = timezone.now() - timedelta(minutes=rule.window_minutes)
            same = cls.objects.filter(node=node, kind=health.Kind.XID, xid=finding.xid, at__gte=since)
            if finding.source == health.Source.TELEMETRY:  # what jobs print never adds to the driver's trend
                same = same.filter(source=health.Source.TELEMETRY)
            recent = same.count()
        backing = corroborating.load(node, finding, attempt, recheck)
        decision = health.decide(finding, health_policy(), rule, recent, backing)
        event = cls.objects.create(
            node=node,
            gpu_index=finding.gpu_index,
            attempt=attempt,
            kind=finding.kind,
            severity=finding.severity,
            xid=finding.xid,
            message=finding.message,
            evidence={**finding.evidence, "decision": decision.why, **corroborating.refs(backing, decision)},
            action=cls.action_of(decision),
            source=finding.source,
        )
        if decision.cordon:
            evidence = corroborating.cordon_evidence(node, event)
            reason = f"{finding.message} ({decision.why}){corroborating.also_seen(evidence)}"
            node.auto_cordon(reason, {"health_event": event.pk, **evidence})
        return event, decision

    @classmethod
    def action_of(cls, decision: health.Decision) -> str:
        done = (
            ("cordoned", decision.cordon),
            (cls.SUSPECTED, decision.suspected),
            (cls.JOB_STOPPED, decision.stop_job),
        )
        return ", ".join(a for a, on in done if on) or "recorded"


def health_policy() -> health.Policy:
    return health.Policy(
        cordon_kinds=frozenset(settings.HANGAR_HEALTH_CORDON_KINDS),
        stop_kinds=frozenset(settings.HANGAR_HEALTH_STOP_JOB_KINDS),
    )


class XidPolicy(models.Model):
    """What an Xid means for the node: the default table is seeded by a migration (and kept by
    `ensure_defaults`); operators edit it."""

    ACTIONS = [
        (health.Action.CORDON, "Cordon"),
        (health.Action.TREND, "Record and trend"),
        (health.Action.IGNORE, "Ignore (application)"),
    ]

    xid = models.PositiveIntegerField(unique=True)
    action = models.CharField(max_length=8, choices=ACTIONS)
    threshold = models.PositiveSmallIntegerField(
        default=health.DEFAULT_XID_THRESHOLD, help_text="Trend: cordon at this many in the window."
    )
    window_minutes = models.PositiveIntegerField(default=health.DEFAULT_XID_WINDOW_MINUTES)
    description = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["xid"]
        verbose_name = "Xid policy"
        verbose_name_plural = "Xid policy"

    def __str__(self) -> str:
        return f"Xid {self.xid}: {self.action}"

    @classmethod
    def ensure_defaults(cls, **kwargs) -> None:
        """A post_migrate receiver: the default table's rows exist (an operator's edits are kept).
        After `migrate`, and after a `flush`: tests that empty the database left later tests of
        their worker with no table, which the migration had seeded once."""
        present = set(cls.objects.values_list("xid", flat=True))
        cls.objects.bulk_create(
            cls(xid=xid, action=action, description=description)
            for xid, (action, description) in health.DEFAULT_XID_POLICY.items()
            if xid not in present
        )

    @classmethod
    def rule_for(cls, xid: int) -> health.XidRule:
        row = cls.objects.filter(xid=xid).first()
        if row is not None:
            return health.XidRule(row.action, row.threshold, row.window_minutes)
        if xid in health.DEFAULT_XID_POLICY:
            return health.XidRule(health.DEFAULT_XID_POLICY[xid][0])
        return health.XidRule(health.Action.TREND)


class FaultInjection(models.Model):
    """A fault to inject on a simulated node; its agent picks it up at its next heartbeat."""

    KINDS = [(k, k) for k in FAULT_KINDS]

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="faults")
    kind = models.CharField(max_length=16, choices=KINDS)
    gpu_index = models.PositiveSmallIntegerField(null=True, blank=True, help_text="Blank: every GPU.")
    xid = models.PositiveIntegerField(null=True, blank=True)
    seconds = models.FloatField(default=30.0, help_text="How long throttling or silence lasts.")
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.kind} on {self.node}"

    @classmethod
    def take_pending(cls, node: Node) -> list["FaultInjection"]:
        """Faults not yet applied on this node, claimed so that each is applied once."""
        taken = []
        for fault in cls.objects.filter(node=node, applied_at=None).order_by("pk"):
            if cls.objects.filter(pk=fault.pk, applied_at=None).update(applied_at=timezone.now()):
                taken.append(fault)
        return taken


class CachedEnvironment(models.Model):
    """A Python environment built and cached on a node (agent/envcache.py), as its agent reports
    it: the node page lists them, and the scheduler prefers a node that holds a job's one."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="cached_environments")
    hash = models.CharField(max_length=64, help_text="Of the exact resolved packages, Python version and platform.")
    keys = models.JSONField(default=list, blank=True, help_text="Requirement keys (as jobs ask) resolved to it.")
    python = models.CharField(max_length=100, blank=True, help_text="e.g. cpython-3.11.7-linux-x86_64.")
    packages = models.PositiveIntegerField(default=0, help_text="Packages installed in it.")
    size_bytes = models.BigIntegerField(default=0)
    built_at = models.DateTimeField(null=True, blank=True)
    build_seconds = models.FloatField(default=0.0)
    last_used_at = models.DateTimeField(null=True, blank=True)
    jobs = models.PositiveIntegerField(default=0, help_text="Jobs that have run in it on this node.")

    class Meta:
        ordering = ["node", "-last_used_at"]
        constraints = [models.UniqueConstraint(fields=["node", "hash"], name="cached_environment_per_node")]

    def __str__(self) -> str:
        return f"{self.hash[:12]} on {self.node}"

    @classmethod
    def report(cls, node: Node, entries: list[dict]) -> None:
        """Make the node's rows what its agent found in its cache (each entry: this model's fields)."""
        with transaction.atomic():
            cls.objects.filter(node=node).exclude(hash__in=[e["hash"] for e in entries]).delete()
            for entry in entries:
                cls.objects.update_or_create(node=node, hash=entry["hash"], defaults=entry)
