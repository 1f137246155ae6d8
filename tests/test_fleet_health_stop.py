"""A job whose process dies of a hardware fault before the agent's stop reaches it is requeued as infra."""

import sys
import threading
import time

import pytest
from django.utils import timezone

from agent import runner as execution
from agent import running
from fleet import health
from fleet.models import GPU, HealthEvent
from jobs import scheduler
from jobs.models import AttemptState, FailureClass, JobState
from tests.factories import make_job, make_node

# Exits 1 on its own a moment after it starts, like a process killed by an Xid/ECC fault
# (the CUDA runtime aborts it) before the agent's next telemetry sample stops it.
DIES = "import time; time.sleep(1.5); raise SystemExit(1)"


@pytest.fixture(autouse=True)
def no_agent_in_this_process():
    running.CURRENT = None
    yield
    running.CURRENT = None


@pytest.mark.parametrize(("fault_gpu", "expected"), [(0, FailureClass.INFRA), (1, FailureClass.USER)])
def test_a_process_that_exits_after_a_stopping_fault_on_its_gpus_is_infra(
    transactional_db, project, owner, fault_gpu, expected
):
    node = make_node("node-a", gpus=2)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    job = make_job(project, owner, command=[sys.executable, "-c", DIES], max_retries=1)
    (attempt,) = scheduler.schedule_pass()
    assert attempt.gpu_indices == [0]

    def fault_while_it_runs():
        deadline = time.monotonic() + 60  # the first job of a process also sets up MLflow tracking: seconds
        while not type(attempt).objects.filter(pk=attempt.pk, state=AttemptState.RUNNING).exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        finding = health.Finding(health.Kind.ECC, "critical", f"GPU {fault_gpu}: 1 uncorrectable ECC errors", fault_gpu)
        HealthEvent.record(node, finding)  # recorded; the stop does not reach the process in time

    recorder = threading.Thread(target=fault_while_it_runs)
    recorder.start()
    execution.run_attempt(attempt.pk)
    recorder.join()

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == AttemptState.FAILED and attempt.exit_code == 1
    assert attempt.failure_class == expected, attempt.reason
    if expected == FailureClass.INFRA:
        assert "health event" in attempt.reason and "ECC" in attempt.reason
        assert job.state == JobState.QUEUED and job.retries == 0  # requeued without using a retry
    else:
        assert job.retries == 1  # the user's own failure uses the retry budget
