"""Small factories for test data (users, projects, nodes, jobs, attempts) and API clients."""

import os
import subprocess
import sys
import threading

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from rest_framework.test import APIClient

from fleet.models import GPU, Node
from jobs.models import Attempt, Job
from portal.models import ApiToken, Membership, Project
from tests.livestack import BASE_DIR, ServicesDatabase


def make_user(username: str, **extra):
    return get_user_model().objects.create_user(username=username, password="pw-" + username, **extra)


def make_project(slug: str, **members) -> Project:
    project = Project.objects.create(slug=slug, name=slug.title())
    for role, user in members.items():
        Membership.objects.create(project=project, user=user, role=role)
    return project


def make_node(name: str = "node-a", gpus: int = 4, model: str = "H100", **fields) -> Node:
    from django.utils import timezone

    node = Node.objects.create(
        name=name, gpu_model=model, gpu_count=gpus, simulated=True, last_heartbeat_at=timezone.now(), **fields
    )
    for index in range(gpus):
        GPU.objects.create(node=node, index=index, uuid=f"GPU-{name}-{index}", model=model, memory_total_mb=81559)
    return node


def make_job(project: Project, user, **fields) -> Job:
    fields = {"name": "train", "command": ["python", "train.py"], "max_runtime_seconds": 3600, **fields}
    return Job.objects.create(project=project, submitted_by=user, **fields)


def make_attempt(job: Job, node: Node, state: str, gpu_indices: list[int] | None = None, **fields) -> Attempt:
    """An attempt in `state`, with its job moved to the matching state."""
    Job.objects.filter(pk=job.pk).update(state=state)
    number = job.attempts.count() + 1
    return Attempt.objects.create(
        job=job,
        number=number,
        node=node,
        state=state,
        gpu_indices=gpu_indices or [0],
        queued_at=job.queued_at,
        **fields,
    )


def make_snapshot(project: Project, user, files: dict[str, str], tmp_dir):
    """A code snapshot of `files` (path -> text) stored in `project`, as `hangar submit --code` makes it."""
    import io
    from pathlib import Path

    from hangar.snapshots import pack
    from jobs.snapshots import receive

    root = Path(tmp_dir)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    packed = pack(root)
    snapshot, _ = receive(project, packed.sha256, io.BytesIO(packed.data), len(packed.data), user)
    return snapshot


def api_client(user=None) -> APIClient:
    client = APIClient()
    if user is not None:
        _, raw = ApiToken.issue(user, "test")
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def token_client(user, project: Project | None = None, read_only: bool = False) -> APIClient:
    """A client authenticated by a token that may be limited to one project and to reading."""
    client = APIClient()
    _, raw = ApiToken.issue(user, "test", project=project, read_only=read_only)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def services_database() -> ServicesDatabase:
    """PostgreSQL + Redis for a services-mode stack: skipped with the reason where they are
    not reachable, a failure under CI (CI=true), which must run them."""
    services = ServicesDatabase()
    if missing := services.available():
        if os.environ.get("CI"):
            pytest.fail(f"services mode must run in CI: {missing}")
        pytest.skip(missing)
    return services


def on_postgresql(script: str, **env: str) -> subprocess.CompletedProcess:
    """Run a Python script (Django set up by it) on a PostgreSQL database of its own: the
    suite's database is SQLite. Skipped, or failed under CI, as services_database says."""
    with services_database() as services:
        return subprocess.run(
            [sys.executable, "-c", script],
            cwd=BASE_DIR,
            env={**os.environ, **services, "DJANGO_SETTINGS_MODULE": "portal.settings", **env},
            capture_output=True,
            text=True,
            timeout=120,
        )


def in_thread(call, results: list) -> threading.Thread:
    """Run `call` on a thread of its own (with its own database connection, closed after),
    appending what it returns to `results`."""

    def run():
        try:
            results.append(call())
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread
