"""The node agent: registers this machine and its GPUs, then keeps reporting.

The agent process is a Celery worker consuming its node's queue (see
`manage.py agent`); this module is the part beside the worker: inventory,
heartbeats, telemetry, the health monitor (telemetry and the jobs' own
output) and fault injection on simulated nodes.
"""

import logging
import queue
import socket
import threading
import time
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, close_old_connections, transaction
from django.utils import timezone
from django.utils.text import slugify

from agent import envcache, running, stress  # noqa: F401  (stress: its receiver runs the burn-in step here)
from agent.output import replay_spools
from agent.watch import handle_finding
from fleet import health
from fleet.gpus import GpuProvider, GpuSample
from fleet.models import GPU, FaultInjection, Node, NodeState, TelemetrySample
from jobs.models import STARTED_ATTEMPT_STATES, Attempt, AttemptState, FailureClass, Stream

log = logging.getLogger("hangar.agent")

COMPACT_EVERY_SECONDS = 600


def default_node_name() -> str:
    return slugify(socket.gethostname()) or "local"


class Agent:
    def __init__(self, name: str, provider: GpuProvider, heartbeat_seconds: float):
        self.name = name
        self.provider = provider
        self.heartbeat_seconds = heartbeat_seconds
        self.node: Node | None = None
        self.previous: dict[int, GpuSample] = {}
        self.silent_until = 0.0
        self.next_compact = 0.0
        # (mode, reason) the agent command found at start: shown as a badge on the node and fleet pages.
        self.isolation: tuple[str, str] = ("none", "")
        # (what a job's `python` is here, why a job uid cannot run it): checked at start.
        self.job_python: tuple[str, str] = ("", "")
        self.refused_environments: dict[str, str] = {}  # name -> why a job uid cannot run its Python here
        # Where the other nodes reach this one (agent/network.py); the command sets them.
        self.address = ""
        self.network_interface = ""

    def register(self, accept_inventory: bool = False) -> Node:
        """Create or update this node and its GPUs from the provider's inventory.

        Real GPUs the node had registered that the driver no longer lists stay registered
        (as lost) and the node is unhealthy: a GPU vanishing from the driver is a fault.
        After a deliberate hardware change, `accept_inventory` makes the new list the node's.
        """
        inventory = self.provider.inventory()
        model = inventory[0].model if inventory else "none"
        listed = [g.index for g in inventory]
        vanished = []
        if not (self.provider.simulated or accept_inventory):  # a simulated node's GPU count is configuration
            registered = GPU.objects.filter(node__name=self.name).values_list("index", flat=True)
            vanished = sorted(set(registered) - set(listed))
        with transaction.atomic():
            node, _ = Node.objects.update_or_create(
                name=self.name,
                defaults={
                    "hostname": socket.gethostname(),
                    "address": self.address,
                    "network_interface": self.network_interface,
                    "gpu_model": model,
                    "gpu_count": len(inventory) + len(vanished),
                    "simulated": self.provider.simulated,
                    "last_heartbeat_at": timezone.now(),
                    "isolation": self.isolation[0],
                    "isolation_reason": self.isolation[1],
                    "job_python": self.job_python[0],
                    "job_python_problem": self.job_python[1],
                    "refused_environments": self.refused_environments,
                },
            )
            node.gpus.exclude(index__in=listed + vanished).delete()
            node.gpus.filter(index__in=vanished).update(lost=True)
            for gpu in inventory:
                GPU.objects.update_or_create(
                    node=node,
                    index=gpu.index,
                    defaults={"uuid": gpu.uuid, "model": gpu.model, "memory_total_mb": gpu.memory_total_mb},
                )
        self.node = node
        running.CURRENT = self  # preflight and the stress step ask its provider
        self.end_orphaned_attempts()
        self.replay_log_spools()
        if vanished:
            reason = f"the driver lists {len(listed)} of {node.gpu_count} registered GPUs (missing {vanished})"
            node.mark_unhealthy(reason, {"listed_gpus": listed, "missing_gpus": vanished})
        node.heartbeat()
        return node

    def end_orphaned_attempts(self) -> None:
        """Attempts a previous agent on this node was running died with it."""
        for attempt in Attempt.objects.filter(node=self.node, state__in=STARTED_ATTEMPT_STATES):
            attempt.finish(AttemptState.LOST, FailureClass.INFRA, "the node's agent restarted while it ran")

    def replay_log_spools(self) -> None:
        """Log lines spooled to disk and never sent: by a previous agent that died, or by a writer
        whose rank ended while the database was still unreachable."""
        try:
            sent = replay_spools(self.node.pk)
        except Exception:  # lines left on disk never keep the agent from starting
            log.exception("node %s: log spool files not replayed", self.name)
            return
        if sent:
            log.info("node %s: sent %d log spool files left unsent", self.name, sent)

    def report(self) -> None:
        """One heartbeat: apply injected faults, sample the GPUs, store telemetry, act on findings."""
        if self.provider.simulated:
            self.apply_faults()  # faults are injected into simulated GPUs only
        if time.monotonic() < self.silent_until:
            return  # an injected "agent silent" fault: no heartbeat, no telemetry
        busy = {i for runner in running.running() for i in runner.attempt.gpu_indices}
        try:
            samples = self.provider.sample(busy)
        except Exception as exc:  # the agent is alive, the driver is not: unhealthy, not offline
            # Before the heartbeat, which would bring an offline node back as ready for a moment.
            self.node.mark_unhealthy(f"the GPU driver did not answer: {type(exc).__name__}: {exc}", {"error": str(exc)})
            self.node.heartbeat()
            return
        self.store(samples, timezone.now())
        self.node.heartbeat()
        envcache.report(self.node)  # its cached environments: the node page, the scheduler's affinity
        findings = health.telemetry_findings(self.previous, samples)
        self.previous = {s.index: s for s in samples}  # a finding is acted on once, even if acting fails
        for finding in findings:
            try:
                handle_finding(self.node, finding)
            except Exception:
                log.exception("node %s: health finding %s not handled", self.node.name, finding.kind)
        self.update_condition(samples)
        self.compact()

    def update_condition(self, samples: list[GpuSample]) -> None:
        """Mark the node unhealthy while it cannot use all its GPUs; ready again once it can.
        (Runs after the findings, so a fault the policy cordons for stays a cordon.)"""
        reason, evidence = health.unhealthy_reason(self.node.gpu_count, samples)
        if reason:
            self.node.mark_unhealthy(reason, evidence)
        elif self.node.state == NodeState.UNHEALTHY:
            # One conditional write per heartbeat only while this agent last saw it unhealthy.
            self.node.mark_healthy("every registered GPU answers again")
            self.node.refresh_from_db(fields=["state"])

    def store(self, samples: list[GpuSample], now) -> None:
        gpus = {g.index: g for g in self.node.gpus.all()}
        rows = []
        for sample in samples:
            gpu = gpus.get(sample.index)
            if gpu is None:
                continue
            gpu.apply(sample, now)
            rows.append(TelemetrySample.from_sample(self.node, sample, now, self.heartbeat_seconds))
        with transaction.atomic():
            GPU.save_telemetry(gpus.values())
            TelemetrySample.objects.bulk_create(rows)

    def compact(self) -> None:
        if time.monotonic() < self.next_compact:
            return
        self.next_compact = time.monotonic() + COMPACT_EVERY_SECONDS
        cutoff = timezone.now() - timedelta(hours=settings.HANGAR_TELEMETRY_RAW_HOURS)
        TelemetrySample.downsample(self.node, cutoff)

    def apply_faults(self) -> None:
        for fault in FaultInjection.take_pending(self.node):
            log.warning("injecting fault %s on %s (GPU %s)", fault.kind, self.name, fault.gpu_index)
            if fault.kind == "agent_silent":
                self.silent_until = time.monotonic() + fault.seconds
            elif fault.kind == "nccl":
                self.report_injected_nccl(fault.gpu_index)
                inject_nccl_failure(fault.gpu_index)
            elif hasattr(self.provider, "inject"):
                self.provider.inject(fault.kind, fault.gpu_index, fault.xid, fault.seconds)
            if fault.kind == "clear":
                self.silent_until = 0.0

    def report_injected_nccl(self, gpu_index: int | None) -> None:
        """An injected NCCL failure is the simulated node's own report (like the driver's), recorded
        before its line reaches the jobs' output, where it would be only a suspicion."""
        where = f"GPU {gpu_index}" if gpu_index is not None else "every GPU"
        finding = health.Finding(
            health.Kind.NCCL, "critical", f"{where}: simulated NCCL failure", gpu_index, None, {"injected": True}
        )
        try:
            handle_finding(self.node, finding)
        except Exception:
            log.exception("node %s: injected NCCL failure not recorded", self.name)

    def heartbeat_forever(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_seconds):
            try:
                self.report()
                self.replay_log_spools()  # lines a writer gave up on while the database was away
            except DatabaseError as exc:
                log.warning("heartbeat failed: %s", exc)
                close_old_connections()
            except Exception:
                log.exception("heartbeat failed")


def inject_nccl_failure(gpu_index: int | None) -> None:
    """A simulated NCCL failure: the line a real job would print, on the stderr of the jobs running there."""
    for runner in running.running():
        if gpu_index is None or gpu_index in runner.attempt.gpu_indices:
            text = f"node{runner.attempt.node_id}:{runner.proc.pid if runner.proc else 0} NCCL WARN [simulated] "
            text += "Call to ibv_post_send failed: unhandled system error"
            try:  # the queue is bounded: a flooded one must not stall the heartbeat
                runner.lines.put((Stream.STDERR, timezone.now(), text.encode(), False), timeout=5)
            except queue.Full:
                log.warning("attempt %s: simulated NCCL line dropped, its output queue is full", runner.attempt.pk)
