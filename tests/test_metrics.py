"""/metrics: parsed with prometheus-client's own parser, its values match the database."""

import os
import textwrap
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from fleet.models import GPU
from jobs import metrics
from jobs.models import AttemptState, FailureClass, JobState
from tests.factories import make_attempt, make_job, make_node

SCRAPE_TOKEN = "s3cret-scrape"


@pytest.fixture(autouse=True)
def fresh_totals():
    metrics.reset()


@pytest.fixture(autouse=True)
def scrape_token(settings):
    settings.HANGAR_METRICS_TOKEN = SCRAPE_TOKEN


def scrape(client, **headers) -> dict:
    response = client.get("/metrics", **{"HTTP_AUTHORIZATION": f"Bearer {SCRAPE_TOKEN}", **headers})
    assert response.status_code == 200, response.content
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def known_sequence(project, owner):
    """Two nodes (one cordoned), a job that succeeded, one that failed, one running, one queued."""
    now = timezone.now()
    a, b = make_node("node-a", gpus=4), make_node("node-b", gpus=2, model="A100")
    b.cordon(owner, "fan noise")
    GPU.objects.filter(node=a, index=1).update(utilization_pct=87.5, temperature_c=71, last_xid=79)
    done = make_job(project, owner, name="ok", queued_at=now - timedelta(seconds=30))
    make_attempt(
        done,
        a,
        AttemptState.SUCCEEDED,
        scheduled_at=now - timedelta(seconds=28),
        started_at=now - timedelta(seconds=27.98),
        running_at=now - timedelta(seconds=27),
        finished_at=now,
    )
    failed = make_job(project, owner, name="bad", queued_at=now - timedelta(seconds=10))
    make_attempt(
        failed,
        a,
        AttemptState.FAILED,
        failure_class=FailureClass.USER,
        started_at=now - timedelta(seconds=9),
        running_at=now - timedelta(seconds=8.5),
    )
    type(failed).objects.filter(pk=failed.pk).update(state=JobState.FAILED, failure_class=FailureClass.USER)
    running = make_job(project, owner, name="run", gpus_per_node=2)
    make_attempt(running, a, AttemptState.RUNNING, gpu_indices=[2, 3], started_at=now, running_at=now)
    make_job(project, owner, name="wait", priority="low", queued_at=now - timedelta(minutes=5))


def test_it_matches_the_database_after_a_known_sequence(client, project, owner):
    known_sequence(project, owner)
    samples = scrape(client)
    assert value(samples, "hangar_nodes", state="ready", gpu_model="H100") == 1
    assert value(samples, "hangar_nodes", state="cordoned", gpu_model="A100") == 1
    assert value(samples, "hangar_node_info", node="node-b", state="cordoned", gpu_model="A100") == 1
    assert value(samples, "hangar_gpus", state="busy", gpu_model="H100") == 2
    assert value(samples, "hangar_gpus", state="free", gpu_model="H100") == 2
    assert value(samples, "hangar_gpus", state="cordoned", gpu_model="A100") == 2
    gpu1 = {"gpu": "1", "UUID": "GPU-node-a-1", "modelName": "H100", "Hostname": "node-a"}
    assert value(samples, "DCGM_FI_DEV_GPU_UTIL", **gpu1) == 87.5
    assert value(samples, "DCGM_FI_DEV_GPU_TEMP", **gpu1) == 71
    assert value(samples, "DCGM_FI_DEV_XID_ERRORS", **gpu1) == 79
    assert value(samples, "hangar_queue_waiting_jobs", priority="low", project="vision") == 1
    assert 299 < value(samples, "hangar_queue_oldest_wait_seconds", priority="low") < 330
    assert value(samples, "hangar_jobs_finished_total", outcome="succeeded", failure_class="none") == 1
    assert value(samples, "hangar_jobs_finished_total", outcome="failed", failure_class="user") == 1
    assert value(samples, "hangar_jobs_submitted_total", priority="normal") == 3
    assert value(samples, "hangar_jobs", state="running") == 1
    assert value(samples, "hangar_attempts_started_total") == 3
    assert value(samples, "hangar_attempts_finished_total", outcome="failed", failure_class="user") == 1
    assert value(samples, "hangar_job_start_latency_seconds_count") == 3
    assert value(samples, "hangar_job_start_latency_seconds_bucket", le="2.5") == 2  # 1.5 s and 0 s
    assert value(samples, "hangar_job_start_latency_seconds_bucket", le="5.0") == 3  # and 3 s
    assert value(samples, "hangar_job_start_latency_seconds_bucket", le="+Inf") == 3
    assert value(samples, "hangar_attempt_handoff_gap_seconds_bucket", le="0.025") == 3
    # A second scrape (the settled attempts now counted once, from the cache) says the same.
    again = scrape(client)
    assert value(again, "hangar_job_start_latency_seconds_count") == 3
    assert value(again, "hangar_attempts_finished_total", outcome="succeeded", failure_class="none") == 1


def test_it_counts_api_requests_by_route(client, owner):
    client.force_login(owner)
    client.get("/api/v1/jobs/")
    samples = scrape(client)
    routed = [k for k in samples if k[0] == "hangar_http_request_duration_seconds_count"]
    assert any(dict(labels).get("route") == "/api/v1/jobs/" for _, labels in routed), routed


def test_it_counts_log_lines_stored(client, project, owner):
    from jobs.logstore import NewLine, store_lines
    from jobs.models import Stream

    node = make_node()
    attempt = make_attempt(make_job(project, owner), node, AttemptState.RUNNING)
    rows = [
        NewLine(attempt.job_id, attempt.pk, node.pk, 0, Stream.STDOUT, 20, False, timezone.now(), f"line {i}", i + 1)
        for i in range(3)
    ]
    store_lines(attempt.pk, rows)
    assert value(scrape(client), "hangar_log_lines_ingested_total") >= 3


def test_it_sums_what_other_processes_measured(db, tmp_path):
    """A scheduler process's pass timings reach the scrape through prometheus-client's multiprocess
    files: what a separate process observed is summed by a collector over the directory. A directory
    of this test's own, for both sides: under parallel workers other tests' schedulers write passes
    into the shared one between two scrapes (and this process must keep writing its own there)."""
    import subprocess
    import sys

    from django.conf import settings
    from prometheus_client import CollectorRegistry, multiprocess

    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(settings.PROMETHEUS_MULTIPROC_DIR)  # what render() reads
    code = "import django; django.setup(); from jobs.metrics import SCHEDULER_PASS as h; "
    code += "[h.observe(0.02) for _ in range(3)]"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "HANGAR_DATA_DIR": str(settings.DATA_DIR),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=settings.BASE_DIR, timeout=60)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    samples = {}
    for family in registry.collect():
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    assert value(samples, "hangar_scheduler_pass_duration_seconds_count") == 3
    assert value(samples, "hangar_scheduler_pass_duration_seconds_bucket", le="0.025") == 3


def test_the_dashboard_and_alerts_use_only_metrics_hangar_exports(client, project, owner):
    import json
    import re
    from pathlib import Path

    import yaml
    from django.conf import settings

    known_sequence(project, owner)
    GPU.objects.update(power_w=300, sm_clock_mhz=1980, memory_used_mb=100)
    client.get("/api/v1/jobs/")
    exported = {name for name, _ in scrape(client)}
    docs = Path(settings.BASE_DIR) / "docs"
    dashboard = json.loads((docs / "grafana" / "hangar.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = yaml.safe_load((docs / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for group in rules["groups"] for r in group["rules"]]
    used = {m for e in exprs for m in re.findall(r"\b(hangar_[a-z_]+|DCGM_FI_[A-Z_]+)\b", e)}
    assert used and used <= exported, used - exported


def test_a_stack_started_by_a_test_keeps_out_of_the_test_processs_metrics_folder(tmp_path):
    """A stack's `up` empties its metrics folder at start: given this process's (settings export it),
    it emptied the folder whose files this worker's later scrapes read (two tests failed in CI)."""
    from tests.livestack import LiveStack

    stack = LiveStack(data_dir=str(tmp_path))

    assert "PROMETHEUS_MULTIPROC_DIR" in os.environ
    assert "PROMETHEUS_MULTIPROC_DIR" not in stack.env


PG_SCRIPT = textwrap.dedent(
    """
    import django
    django.setup()
    from datetime import timedelta
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from django.db import connection
    assert connection.vendor == "postgresql", connection.vendor
    from django.test import Client
    from django.utils import timezone
    from prometheus_client.parser import text_string_to_metric_families
    from tests.factories import make_attempt, make_job, make_node, make_project, make_user
    user = make_user("ada"); project = make_project("vision", admin=user); node = make_node("node-a")
    now = timezone.now()
    job = make_job(project, user, name="ok", queued_at=now - timedelta(seconds=30))
    make_attempt(
        job, node, "succeeded", scheduled_at=now - timedelta(seconds=28), started_at=now - timedelta(seconds=27.98),
        running_at=now - timedelta(seconds=27), finished_at=now,
    )
    for _ in range(2):  # the first scrape reads the ended attempts, the second adds to what it kept
        response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer pg-scrape")
        assert response.status_code == 200, response.content[-3000:]
    families = text_string_to_metric_families(response.content.decode())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    print("count", samples[("hangar_job_start_latency_seconds_count", ())])
    print("sum", samples[("hangar_job_start_latency_seconds_sum", ())])
    print("gap", samples[("hangar_attempt_handoff_gap_seconds_sum", ())])
    """
)


def test_the_scrape_answers_on_postgresql_once_attempts_exist():
    """PostgreSQL's EXTRACT(EPOCH ...) is numeric (a Decimal in Python): the histograms summed it
    into a float and /metrics answered 500 as soon as an attempt had run."""
    from tests.factories import on_postgresql

    run = on_postgresql(PG_SCRIPT, HANGAR_METRICS_TOKEN="pg-scrape")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.split(" ", 1)[0] in PG_KEYS)
    assert float(found["count"]) == 1
    assert 2.9 < float(found["sum"]) < 3.1 and 0.01 < float(found["gap"]) < 0.03, found


PG_KEYS = ("count", "sum", "gap")
