"""The floors hold: which process loads which app, and the pieces that moved with the layout."""

import subprocess
import sys

from agent import watch
from tests.factories import api_client, make_attempt, make_job
from tests.livestack import BASE_DIR

LOADED = (
    "import os, sys, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'portal.settings'); django.setup(); "
    "{imports}; print(sorted(m for m in sys.modules if m.startswith('agent.') and m != 'agent.apps'))"
)


def loaded_agent_modules(imports: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", LOADED.format(imports=imports)], capture_output=True, text=True, cwd=BASE_DIR, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_web_and_scheduler_processes_load_nothing_of_the_agent():
    # (Django's app registry loads the package and its AppConfig, agent/apps.py; nothing else.)
    web = "import portal.urls, portal.asgi; from django.urls import get_resolver; get_resolver().url_patterns"
    scheduler = "import jobs.tasks, jobs.scheduler; from portal.celery import app; app.loader.import_default_modules()"
    assert loaded_agent_modules(web) == "[]"
    assert loaded_agent_modules(scheduler) == "[]"


def test_the_agent_process_loads_its_tasks():
    assert "'agent.runner'" in loaded_agent_modules("from django.core.management import load_command_class; "
                                                   "load_command_class('agent', 'agent')")  # fmt: skip


class FakeAttempt:
    def __init__(self, pk, node=None):
        self.pk, self.node = pk, node
        self.job = type("FakeJob", (), {"submitted_by_id": 1})()


def test_an_ended_attempt_leaves_nothing_in_the_output_watcher(monkeypatch):
    recorded = []
    monkeypatch.setattr(watch, "handle_finding", lambda node, finding, attempt: recorded.append(attempt.pk))
    attempt = FakeAttempt(9001)

    watch.observe_output(attempt, "NCCL WARN Call to ibv_post_send failed: unhandled system error")
    watch.observe_output(attempt, "NCCL WARN Call to ibv_post_send failed: unhandled system error")
    assert recorded == [9001] and 9001 in watch._seen_in_output

    watch.forget(attempt.pk)
    assert 9001 not in watch._seen_in_output


def test_the_priority_classes_come_from_the_server(owner, settings):
    settings.HANGAR_PRIORITY_CLASSES = {
        "normal": {"rank": 10},
        "crunch": {"rank": 50, "may_preempt": True},
    }
    response = api_client(owner).get("/api/v1/priorities/")

    assert response.status_code == 200
    assert [c["name"] for c in response.json()] == ["crunch", "normal"]
    assert response.json()[0] == {"name": "crunch", "rank": 50, "may_preempt": True, "preemptible": False}


def test_an_attempt_of_a_node_that_went_offline_is_lost_through_the_fleet_signal(project, owner, node):
    from fleet import signals
    from jobs.models import AttemptState

    attempt = make_attempt(make_job(project, owner), node, AttemptState.RUNNING)
    signals.node_offline.send(sender=type(node), node=node, reason="no heartbeat")

    attempt.refresh_from_db()
    assert attempt.state == AttemptState.LOST and "no heartbeat" in attempt.reason
