"""Placing queued jobs on free GPUs, reconciling what agents stopped reporting, and cancelling."""

import itertools
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from fleet.models import Node, NodeState
from jobs.models import Attempt, AttemptState, FailureClass, Job, JobEvent, JobState, Priority
from jobs.scheduler import FreeNode, Request, place, reconcile, schedule_pass
from portal.models import AuditEvent
from tests.factories import make_attempt, make_job, make_node

# --- place: the pure decision ---------------------------------------------------


def test_it_picks_the_node_with_the_fewest_free_gpus_that_fits():
    nodes = [FreeNode(1, "H100", [0, 1, 2, 3]), FreeNode(2, "H100", [2, 3]), FreeNode(3, "H100", [3])]

    assert place(Request(2), nodes) == (2, [2, 3])


def test_it_breaks_ties_by_the_lowest_node_id():
    nodes = [FreeNode(7, "H100", [0, 1]), FreeNode(3, "H100", [0, 1])]

    assert place(Request(1), nodes) == (3, [0])


def test_it_respects_the_gpu_type():
    nodes = [FreeNode(1, "A100", [0]), FreeNode(2, "H100", [0, 1, 2, 3])]

    assert place(Request(1, "H100"), nodes) == (2, [0])
    assert place(Request(1, "A100"), nodes) == (1, [0])
    assert place(Request(1), nodes) == (1, [0])


def test_it_returns_none_when_nothing_fits():
    nodes = [FreeNode(1, "H100", [0, 1]), FreeNode(2, "A100", [0, 1, 2, 3])]

    assert place(Request(3, "H100"), nodes) is None
    assert place(Request(5), nodes) is None
    assert place(Request(1, "B300"), nodes) is None
    assert place(Request(1), []) is None


def test_it_takes_the_lowest_free_indices():
    assert place(Request(2), [FreeNode(1, "H100", [3, 1, 2])]) == (1, [1, 2])


# --- schedule_pass: the decision applied to the database ------------------------


@pytest.fixture
def dispatched(monkeypatch) -> list[tuple[int, str]]:
    """What the pass would send to the node agents' queues (the broker is not under test here)."""
    sent: list[tuple[int, str]] = []
    monkeypatch.setattr("jobs.scheduler.dispatch", lambda attempt_id, queue, rank=0: sent.append((attempt_id, queue)))
    return sent


def run_pass(capture) -> list[Attempt]:
    with capture(execute=True):
        return schedule_pass()


def test_it_places_a_queued_job_on_a_ready_node(project, owner, node, dispatched, django_capture_on_commit_callbacks):
    job = make_job(project, owner, gpus_per_node=2)

    placed = run_pass(django_capture_on_commit_callbacks)

    attempt = Attempt.objects.get(job=job)
    assert placed == [attempt]
    assert attempt.state == AttemptState.SCHEDULED
    assert attempt.node == node
    assert attempt.gpu_indices == [0, 1]
    assert attempt.number == 1
    job.refresh_from_db()
    assert job.state == JobState.SCHEDULED
    assert dispatched == [(attempt.pk, "hangar.node.node-a")]
    assert JobEvent.objects.filter(job=job, kind="scheduled", attempt=attempt).exists()


def test_it_never_gives_one_gpu_to_two_jobs(project, owner, node, dispatched, django_capture_on_commit_callbacks):
    jobs = [make_job(project, owner, gpus_per_node=gpus) for gpus in (1, 2, 1, 1)]

    run_pass(django_capture_on_commit_callbacks)
    run_pass(django_capture_on_commit_callbacks)  # a second pass finds the node full

    indices = [i for a in Attempt.objects.filter(node=node) for i in a.gpu_indices]
    assert sorted(indices) == [0, 1, 2, 3]
    states = [Job.objects.get(pk=j.pk).state for j in jobs]
    assert states == [JobState.SCHEDULED, JobState.SCHEDULED, JobState.SCHEDULED, JobState.QUEUED]
    assert len(dispatched) == 3


def test_it_fills_gpus_freed_by_a_finished_attempt(
    project, owner, node, dispatched, django_capture_on_commit_callbacks
):
    first = make_job(project, owner, gpus_per_node=4)
    second = make_job(project, owner, gpus_per_node=2)
    run_pass(django_capture_on_commit_callbacks)
    assert Job.objects.get(pk=second.pk).state == JobState.QUEUED

    first.attempts.get().finish(AttemptState.SUCCEEDED, exit_code=0)
    run_pass(django_capture_on_commit_callbacks)

    assert second.attempts.get().gpu_indices == [0, 1]
    assert Job.objects.get(pk=first.pk).state == JobState.SUCCEEDED


def test_it_skips_a_cordoned_node(project, owner, node, dispatched, django_capture_on_commit_callbacks):
    node.cordon(owner, "bad fan")
    job = make_job(project, owner)

    assert run_pass(django_capture_on_commit_callbacks) == []
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
    assert dispatched == []


def test_it_skips_a_node_whose_heartbeat_is_stale(project, owner, node, dispatched, django_capture_on_commit_callbacks):
    stale = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS + 5)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=stale)
    fresh = make_node("node-b", gpus=8)
    job = make_job(project, owner)

    run_pass(django_capture_on_commit_callbacks)

    assert job.attempts.get().node == fresh
    assert dispatched == [(job.attempts.get().pk, "hangar.node.node-b")]


def test_it_respects_the_gpu_type_of_a_job(project, owner, node, dispatched, django_capture_on_commit_callbacks):
    a100 = make_node("node-b", gpus=2, model="A100")
    job = make_job(project, owner, gpu_type="A100")

    run_pass(django_capture_on_commit_callbacks)

    assert job.attempts.get().node == a100


def test_higher_priority_goes_first_when_capacity_is_short(
    project, owner, node, dispatched, django_capture_on_commit_callbacks
):
    low = make_job(project, owner, gpus_per_node=4, priority=Priority.LOW)
    high = make_job(project, owner, gpus_per_node=4, priority=Priority.HIGH)

    run_pass(django_capture_on_commit_callbacks)

    assert Job.objects.get(pk=high.pk).state == JobState.SCHEDULED
    assert Job.objects.get(pk=low.pk).state == JobState.QUEUED


def test_equal_priority_goes_in_queue_order(project, owner, node, dispatched, django_capture_on_commit_callbacks):
    earlier = make_job(project, owner, gpus_per_node=4, queued_at=timezone.now() - timedelta(minutes=5))
    later = make_job(project, owner, gpus_per_node=4)

    run_pass(django_capture_on_commit_callbacks)

    assert Job.objects.get(pk=earlier.pk).state == JobState.SCHEDULED
    assert Job.objects.get(pk=later.pk).state == JobState.QUEUED


def test_the_queue_follows_the_configured_classes_when_they_change(project, owner, node, settings):
    """The queue's read is compiled once per set of classes (their ranks are in its SQL): a
    change of HANGAR_PRIORITY_CLASSES reorders it, never an order compiled for the old ones."""
    from jobs.scheduler import queued_jobs

    low = make_job(project, owner, priority=Priority.LOW, queued_at=timezone.now() - timedelta(minutes=5))
    high = make_job(project, owner, priority=Priority.HIGH)
    assert [q.job_id for q in queued_jobs()] == [high.pk, low.pk]

    settings.HANGAR_PRIORITY_CLASSES = {Priority.LOW: {"rank": 90}, Priority.HIGH: {"rank": 10}}
    assert [q.job_id for q in queued_jobs()] == [low.pk, high.pk]
    assert [q.rank for q in queued_jobs()] == [90, 10]


# --- reconcile --------------------------------------------------------------------


def test_an_attempt_whose_lease_expired_is_lost_and_its_job_requeued(project, owner, node):
    job = make_job(project, owner)
    past = timezone.now() - timedelta(seconds=1)
    attempt = make_attempt(job, node, AttemptState.RUNNING, running_at=past, lease_expires_at=past)

    reconcile()

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == AttemptState.LOST
    assert attempt.failure_class == FailureClass.INFRA
    assert attempt.finished_at is not None
    assert job.state == JobState.QUEUED
    assert job.requeues == 1
    assert job.finished_at is None
    assert JobEvent.objects.filter(job=job, kind="requeue").exists()


def test_an_attempt_with_a_live_lease_is_left_alone(project, owner, node):
    job = make_job(project, owner)
    attempt = make_attempt(job, node, AttemptState.RUNNING, lease_expires_at=timezone.now() + timedelta(seconds=30))

    reconcile()

    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING
    assert Job.objects.get(pk=job.pk).state == JobState.RUNNING


def test_a_job_that_used_up_its_requeues_fails(project, owner, node, settings):
    job = make_job(project, owner, requeues=settings.HANGAR_MAX_REQUEUES)
    past = timezone.now() - timedelta(seconds=1)
    make_attempt(job, node, AttemptState.RUNNING, lease_expires_at=past)

    reconcile()

    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.failure_class == FailureClass.INFRA


def test_an_attempt_no_agent_started_is_requeued(project, owner, node, settings):
    job = make_job(project, owner)
    long_ago = timezone.now() - timedelta(seconds=settings.HANGAR_START_TIMEOUT_SECONDS + 5)
    attempt = make_attempt(job, node, AttemptState.SCHEDULED, scheduled_at=long_ago)

    reconcile()

    attempt.refresh_from_db()
    assert attempt.state == AttemptState.LOST
    assert "no agent started it" in attempt.reason
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED


def test_a_silent_node_goes_offline(node, settings):
    stale = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS + 5)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=stale)

    reconcile()
    reconcile()  # once only

    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE
    assert "no heartbeat since" in node.state_reason
    events = AuditEvent.objects.filter(action="node.offline", target_type="fleet.node", target_id=str(node.pk))
    assert events.count() == 1
    assert events.get().detail == {"previous_state": "ready"}


def test_a_silent_cordoned_node_keeps_its_cordon(node, owner, settings):
    node.cordon(owner, "bad fan")
    stale = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS + 5)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=stale)

    reconcile()
    node.heartbeat()

    node.refresh_from_db()
    assert (node.state, node.state_reason) == (NodeState.CORDONED, "bad fan")


def test_a_node_with_a_fresh_heartbeat_stays_ready(node):
    reconcile()

    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert not AuditEvent.objects.filter(action="node.offline").exists()


def test_an_offline_node_comes_back_with_its_heartbeat(node):
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE)

    node.heartbeat()

    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert AuditEvent.objects.filter(action="node.online").count() == 1


# --- cancel -----------------------------------------------------------------------


def test_cancelling_a_queued_job_ends_it(project, owner):
    job = make_job(project, owner)

    assert job.cancel(owner, "not needed")

    assert job.state == JobState.CANCELLED
    assert job.failure_class == FailureClass.CANCELLED
    assert job.finished_at is not None
    assert AuditEvent.objects.filter(action="job.cancel", target_id=str(job.pk), reason="not needed").exists()
    assert JobEvent.objects.filter(job=job, kind="cancel").exists()


def test_cancelling_a_scheduled_job_cancels_its_attempt(project, owner, node):
    job = make_job(project, owner)
    attempt = make_attempt(job, node, AttemptState.SCHEDULED)

    assert job.cancel(owner)

    attempt.refresh_from_db()
    assert attempt.state == AttemptState.CANCELLED
    assert job.state == JobState.CANCELLED
    assert job.state_reason == "cancelled by owner"


def test_cancelling_a_running_job_asks_its_agent_to_stop(project, owner, node):
    job = make_job(project, owner)
    attempt = make_attempt(job, node, AttemptState.RUNNING)

    assert job.cancel(owner, "wrong data")
    assert not job.cancel(owner, "again")  # already asked

    attempt.refresh_from_db()
    assert attempt.cancel_requested_at is not None
    assert attempt.state == AttemptState.RUNNING
    assert attempt.reason == "wrong data"
    assert job.state == JobState.RUNNING


def test_a_running_job_asked_to_cancel_ends_cancelled_whatever_its_exit(project, owner, node):
    job = make_job(project, owner)
    attempt = make_attempt(job, node, AttemptState.RUNNING)
    job.cancel(owner, "stop")

    attempt.finish(AttemptState.FAILED, FailureClass.USER, "killed by SIGTERM (exit code 143)", exit_code=143)

    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert job.failure_class == FailureClass.CANCELLED


def test_cancelling_a_finished_job_does_nothing(project, owner):
    job = make_job(project, owner, state=JobState.SUCCEEDED)

    assert not job.cancel(owner)
    assert job.state == JobState.SUCCEEDED
    assert not AuditEvent.objects.filter(action="job.cancel").exists()


def test_the_database_refuses_a_second_live_attempt(project, owner, node):
    job = make_job(project, owner)
    make_attempt(job, node, AttemptState.RUNNING, gpu_indices=[0])

    with pytest.raises(IntegrityError), transaction.atomic():
        Attempt.objects.create(
            job=job, number=2, node=node, state=AttemptState.SCHEDULED, gpu_indices=[1], queued_at=job.queued_at
        )

    assert job.attempts.count() == 1


def test_a_finished_attempt_does_not_block_a_new_one(project, owner, node):
    job = make_job(project, owner)
    make_attempt(job, node, AttemptState.RUNNING).finish(AttemptState.LOST, FailureClass.INFRA, "node died")

    second = make_attempt(job, node, AttemptState.SCHEDULED)

    assert second.number == 2


@pytest.fixture
def wakeups(monkeypatch) -> list[float]:
    """Wake-ups as they leave for the broker (the edge of this process), from a new waker."""
    from portal import wakeup

    sent: list[float] = []
    monkeypatch.setattr(wakeup, "_publish_wakeup", lambda requested_at, queue_at: sent.append(time.monotonic()) or True)
    monkeypatch.setattr(wakeup, "_waker", wakeup.Waker())
    return sent


def wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def settled(wakeups: list[float]) -> int:
    """How many wake-ups have left, once none has for three coalescing windows."""
    from portal import wakeup

    while True:
        count = len(wakeups)
        time.sleep(wakeup.WAKEUP_COALESCE_SECONDS * 3)
        if len(wakeups) == count:
            return count


def test_a_burst_of_wakeups_sends_one_at_once_and_one_trailing(wakeups):
    from portal import wakeup

    asked = time.monotonic()
    for _ in range(20):
        wakeup.send_pass_request()
    wait_for(lambda: wakeups)
    assert wakeups[0] - asked < 1.0  # the first goes at once
    # The rest share the first (asked before it left) or one trailing send.
    before = settled(wakeups)
    assert before in (1, 2)
    wakeup.send_pass_request()
    assert settled(wakeups) == before + 1
    gaps = [later - earlier for earlier, later in itertools.pairwise(wakeups)]
    assert min(gaps) >= wakeup.WAKEUP_COALESCE_SECONDS * 0.9


def slow_sends(monkeypatch, seconds: float) -> tuple[threading.Event, list[tuple[float, float | None, float]]]:
    """A new waker whose sends each take `seconds`, as its last one did (so its requests go to
    its thread): (set at the first send, and each send's requested_at, queue_at and the
    wall-clock time it left)."""
    from portal import wakeup

    sending, sent = threading.Event(), []

    def slow_publish(requested_at, queue_at):
        sent.append((requested_at, queue_at, time.time()))
        sending.set()
        time.sleep(seconds)
        return True

    monkeypatch.setattr(wakeup, "_publish_wakeup", slow_publish)
    monkeypatch.setattr(wakeup, "_waker", wakeup.Waker())
    wakeup._waker.quick = False
    return sending, sent


def test_a_request_after_a_quiet_spell_is_sent_by_its_caller_at_once(monkeypatch):
    """Not handed to the waker's thread, which got the GIL only once the caller's request
    was done; the requests close behind it are the thread's, sent together after its rest."""
    from portal import wakeup

    sent = []
    publish = lambda requested_at, queue_at: sent.append((threading.current_thread(), time.monotonic())) or True  # noqa: E731
    monkeypatch.setattr(wakeup, "_publish_wakeup", publish)
    monkeypatch.setattr(wakeup, "_waker", wakeup.Waker())
    # The next two requests close to the first, however slow this machine.
    monkeypatch.setattr(wakeup, "WAKEUP_ALONE_SECONDS", 0.3)
    wakeup.send_pass_request()
    assert [thread for thread, _ in sent] == [threading.current_thread()]  # sent before the call returned
    wakeup.send_pass_request()
    wakeup.send_fleet_pass_request()
    wait_for(lambda: len(sent) == 2)
    (_, first), (thread, second) = sent
    assert thread is wakeup._waker.thread and second - first >= wakeup.WAKEUP_COALESCE_SECONDS * 0.9
    wait_for(lambda: not wakeup._waker.sending.locked())  # the thread's send is over
    time.sleep(max(wakeup.WAKEUP_ALONE_SECONDS, wakeup.WAKEUP_COALESCE_SECONDS) * 1.5)
    wakeup.send_fleet_pass_request()  # quiet again: its caller sends it
    assert len(sent) == 3 and sent[2][0] is threading.current_thread()


def test_requests_close_together_are_sent_by_the_thread_however_long_they_go_on(monkeypatch):
    """A flood (many submits a second in one web process) is coalesced by the waker's
    thread, as it was before callers sent: not one send per rest, by whichever caller came
    after it ended."""
    from portal import wakeup

    sent = []
    monkeypatch.setattr(
        wakeup, "_publish_wakeup", lambda requested_at, queue_at: sent.append(threading.current_thread()) or True
    )
    monkeypatch.setattr(wakeup, "_waker", wakeup.Waker())
    # Each request close to the last, however slow this machine.
    monkeypatch.setattr(wakeup, "WAKEUP_ALONE_SECONDS", 1.0)
    ends = time.monotonic() + wakeup.WAKEUP_COALESCE_SECONDS * 6
    while time.monotonic() < ends:
        wakeup.send_pass_request()
        time.sleep(0.005)
    wait_for(lambda: wakeup._waker.requested_at is None and not wakeup._waker.sending.locked())  # all sent
    assert sent[0] is threading.current_thread()  # the first came alone
    assert len(sent) >= 3 and set(sent[1:]) == {wakeup._waker.thread}  # the rest, over several rests


@pytest.mark.parametrize("trouble", ["slow", "failed"])
def test_after_a_send_in_trouble_requests_go_to_the_thread_until_its_sends_are_quick(monkeypatch, trouble):
    """A broker down or struggling holds up one caller, not each: after a slow or failed
    send, asking returns at once and the waker's thread sends; once one of its sends is
    quick again, a request after a quiet spell is its caller's to send once more."""
    from portal import wakeup

    sent, troubled = [], [True]

    def publish(requested_at, queue_at):
        sent.append(threading.current_thread())
        if troubled[0] and trouble == "slow":
            time.sleep(wakeup.QUICK_SEND_SECONDS * 2)
        return not (troubled[0] and trouble == "failed")

    monkeypatch.setattr(wakeup, "_publish_wakeup", publish)
    monkeypatch.setattr(wakeup, "_waker", wakeup.Waker())
    wakeup.send_pass_request()
    assert sent == [threading.current_thread()] and not wakeup._waker.quick
    time.sleep(wakeup.WAKEUP_COALESCE_SECONDS * 1.5)
    wakeup.send_pass_request()
    wait_for(lambda: len(sent) == 2)
    wait_for(lambda: not wakeup._waker.sending.locked())  # that send is over
    assert sent[1] is wakeup._waker.thread and not wakeup._waker.quick  # not its caller's
    troubled[0] = False  # the broker is well again: the thread's next send is quick
    wakeup.send_pass_request()
    wait_for(lambda: len(sent) == 3)
    wait_for(lambda: not wakeup._waker.sending.locked())
    assert sent[2] is wakeup._waker.thread and wakeup._waker.quick
    time.sleep(wakeup.WAKEUP_COALESCE_SECONDS * 1.5)
    wakeup.send_pass_request()
    assert len(sent) == 4 and sent[3] is threading.current_thread()


def test_a_request_asked_while_a_wakeup_is_sent_gets_one_after_it(monkeypatch):
    """Asking does not wait on a slow send of the waker's thread, and a flag raised during
    it is answered by a later send (its commit may have come after the first one left)."""
    from portal import wakeup

    sending, sent = slow_sends(monkeypatch, 1.0)
    wakeup.send_pass_request()
    assert sending.wait(5)
    asked = time.time()
    wakeup.send_pass_request()
    assert time.time() - asked < 0.5  # the caller did not wait for the slow send
    wait_for(lambda: len(sent) == 2)
    assert sent[1][2] >= asked


def test_a_wakeup_carries_the_time_of_the_latest_request_it_answers(monkeypatch):
    """Not the time it leaves: a pass that began after the request (after its commit) covers
    it, however long the send waited for a slow one before it."""
    from portal import wakeup

    sending, sent = slow_sends(monkeypatch, 0.5)
    first = time.time()
    wakeup.send_pass_request()
    assert sending.wait(5)
    wakeup.send_pass_request()
    latest = time.time()
    wakeup.send_pass_request()
    asked = time.time()
    wait_for(lambda: len(sent) == 2)
    assert first <= sent[0][0] <= sent[0][2]
    requested_at, _, left_at = sent[1]
    assert latest <= requested_at <= asked  # the later of the two requests it answers
    assert left_at - requested_at > 0.3  # it left after the slow send before it


def test_a_wakeup_older_than_a_completed_pass_is_skipped(db, monkeypatch):
    from jobs import scheduler, tasks

    monkeypatch.setattr(scheduler, "last_pass_started", 0.0)
    sent_before = time.time() - 2 * scheduler.WAKEUP_CLOCK_MARGIN
    assert not scheduler.pass_already_covers(sent_before)
    schedule_pass()

    assert scheduler.pass_already_covers(sent_before)
    assert tasks.schedule(requested_at=sent_before) == 0
    assert not scheduler.pass_already_covers(time.time())  # sent since: gets its pass
    assert not scheduler.pass_already_covers(None)  # a wake-up of old, without a time


def test_a_wakeup_from_this_machine_needs_no_margin(db, monkeypatch):
    """Sent on this machine (its clock is ours) just before a pass began: that pass read the
    queue after the sender's commit, so it needs no pass of its own. From another machine,
    whose clock may differ, only one older than the pass by the margin is covered."""
    from jobs import scheduler, tasks
    from portal import wakeup

    monkeypatch.setattr(scheduler, "last_pass_started", 0.0)
    monkeypatch.setattr(wakeup, "CLOCK", "this-boot")
    just_before = time.time() - 0.01
    schedule_pass()

    assert scheduler.pass_already_covers(just_before, "this-boot")
    assert tasks.schedule(requested_at=just_before, clock="this-boot") == 0
    assert not scheduler.pass_already_covers(just_before, "another-machine")
    assert not scheduler.pass_already_covers(just_before)  # a sender that did not say
    assert not scheduler.pass_already_covers(time.time(), "this-boot")  # sent since: gets its pass
    monkeypatch.setattr(wakeup, "CLOCK", None)  # no boot id here: every sender gets the margin
    assert not scheduler.pass_already_covers(just_before, None)


def test_a_wakeup_says_which_clock_its_time_reads(monkeypatch):
    from portal import wakeup

    sent = []
    monkeypatch.setattr(wakeup.app, "send_task", lambda name, kwargs, queue: sent.append(kwargs))
    wakeup._publish_wakeup(1234.5, 1200.0)
    assert sent[0]["clock"] == wakeup.clock_id() == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert sent[0]["requested_at"] == 1234.5 and sent[0]["queue_at"] == 1200.0


def test_a_wakeup_says_when_its_latest_request_that_changed_the_queue_was(monkeypatch):
    """A burst's wake-up carries its latest request and, apart, the latest of those that changed
    the queue; one answering only freed GPUs or a node's change says none did."""
    from portal import wakeup

    sending, sent = slow_sends(monkeypatch, 0.3)
    wakeup.send_fleet_pass_request()
    assert sending.wait(5)
    before_queue = time.time()
    wakeup.send_pass_request()  # a submit, while the first send is slow
    between = time.time()
    wakeup.send_fleet_pass_request()  # then an attempt's end
    wait_for(lambda: len(sent) == 2)
    assert sent[0][1] is None  # GPUs freed only
    requested_at, queue_at, _ = sent[1]
    assert before_queue <= queue_at <= between <= requested_at


def test_a_wakeup_for_freed_gpus_is_answered_by_a_pass_that_read_the_fleet_after_it(project, owner, node, monkeypatch):
    """Asked after a pass had read the queue but before it read the fleet under its locks: that
    pass saw the GPUs free, and the wake-up needs no pass of its own, unless its commit
    changed the queue (that pass read it before)."""
    from jobs import scheduler, tasks

    make_job(project, owner, gpus_per_node=node.gpu_count + 1)  # queued, and waits: the pass reads the fleet

    monkeypatch.setattr(scheduler, "last_pass_started", 0.0)
    monkeypatch.setattr(scheduler, "last_pass_locked", 0.0)
    asked = []
    read_queue = scheduler.queued_jobs

    def queue_then_a_request(**how):
        jobs = read_queue(**how)
        asked.append(time.time())  # an attempt ends and asks, between the two reads
        return jobs

    monkeypatch.setattr(scheduler, "queued_jobs", queue_then_a_request)
    schedule_pass()
    monkeypatch.setattr(scheduler, "queued_jobs", read_queue)

    here = scheduler.wakeup.CLOCK
    assert scheduler.last_pass_started < asked[0] < scheduler.last_pass_locked
    assert scheduler.pass_already_covers(asked[0], here, queue_at=None)
    assert tasks.schedule(requested_at=asked[0], clock=here, queue_at=None) == 0
    assert not scheduler.pass_already_covers(asked[0], here, queue_at=asked[0])  # a submit: its job unread
    assert not scheduler.pass_already_covers(asked[0], here)  # a sender that does not say: as a submit
    earlier = scheduler.last_pass_started - 0.01
    assert scheduler.pass_already_covers(asked[0], here, queue_at=earlier)  # a submit before it, a freed GPU after
    assert not scheduler.pass_already_covers(time.time(), here, queue_at=None)  # since: gets its pass


@pytest.mark.parametrize(
    ("state", "failure_class", "queue_changed"),
    [(AttemptState.SUCCEEDED, "", False), (AttemptState.LOST, FailureClass.INFRA, True)],
)
def test_an_attempts_end_says_whether_it_queued_its_job_again(
    project, owner, node, monkeypatch, state, failure_class, queue_changed
):
    from portal import wakeup

    asked = []
    monkeypatch.setattr(wakeup, "request_pass", lambda queue_changed=True: asked.append(queue_changed))
    job = make_job(project, owner)
    make_attempt(job, node, AttemptState.RUNNING).finish(state, failure_class, "ended")

    job.refresh_from_db()
    assert (job.state == JobState.QUEUED) is queue_changed
    assert asked == [queue_changed]


def test_a_pass_over_an_empty_queue_reads_no_more_than_the_queue(db, node, django_assert_num_queries):
    """An idle fleet's finishes each ask for a pass: with nothing queued there is nothing to
    place or make room for, so it takes no locks and reads no fleet."""
    from jobs import scheduler

    scheduler.queued_jobs(placeable_since=timezone.now())  # its statement compiled before counting
    with django_assert_num_queries(1):  # the queue, while a node is schedulable
        assert schedule_pass() == []
    assert scheduler.last_pass_locked >= scheduler.last_pass_started  # it answers a freed GPU asked before it
