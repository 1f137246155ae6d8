"""Shared test data: an owner, a teammate and an outsider, and the projects they belong to."""

import os

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from fleet.models import GPU, Node
from jobs.models import Attempt, Job
from portal.livestack import ServicesDatabase
from portal.models import ApiToken, Membership, Project, Role

# The suite's jobs run as the test's own user, unsandboxed (its interpreter may be out of
# other uids' reach); tests/test_sandbox.py and the agent drills turn isolation on.
os.environ.setdefault("HANGAR_SANDBOX", "off")
os.environ.setdefault("HANGAR_JOB_UID_RANGE", "off")


@pytest.fixture(autouse=True)
def no_isolation_unless_asked(settings):
    settings.HANGAR_SANDBOX = os.environ["HANGAR_SANDBOX"] not in ("off", "0", "false", "no")
    settings.HANGAR_JOB_UID_RANGE = None if os.environ["HANGAR_JOB_UID_RANGE"] == "off" else (200000, 299999)


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


@pytest.fixture(autouse=True)
def fresh_cache():
    # Rate-limit counters live in the cache and are keyed by token or user id,
    # which the next test's rolled-back database hands out again.
    # So do the remembered API tokens, node sizes and budgeted projects (a rolled-back database sends no signal
    # that would make them forgotten).
    from django.core.cache import cache

    cache.clear()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # The default PBKDF2 costs about a second per user made; tests make several.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def owner(db):
    return make_user("owner")


@pytest.fixture
def teammate(db):
    return make_user("teammate")


@pytest.fixture
def outsider(db):
    return make_user("outsider")


@pytest.fixture
def project(owner, teammate):
    return make_project("vision", **{Role.MANAGER: owner, Role.MEMBER: teammate})


@pytest.fixture
def other_project(outsider):
    return make_project("nlp", **{Role.MEMBER: outsider})


@pytest.fixture
def node(db):
    return make_node()


def api_client(user=None) -> APIClient:
    client = APIClient()
    if user is not None:
        _, raw = ApiToken.issue(user, "test")
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture
def roles(db) -> dict:
    """One user per role in project `lab`, and an outsider who is only in project `other`."""
    users = {role: make_user(f"lab-{role}") for role in Role.values}
    users["lab"] = make_project("lab", **{role: users[role] for role in Role.values})
    users["outsider"] = make_user("lab-outsider")
    users["other"] = make_project("other", **{Role.ADMIN: users["outsider"]})
    return users


def token_client(user, project: Project | None = None, read_only: bool = False) -> APIClient:
    """A client authenticated by a token that may be limited to one project and to reading."""
    client = APIClient()
    _, raw = ApiToken.issue(user, "test", project=project, read_only=read_only)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by Playwright (one per test module: Playwright's sync API holds an
    event loop while it lives); missing Chromium fails under CI, skips elsewhere."""
    import os
    from pathlib import Path

    from tests.browsing import CHROMIUM, CHROMIUM_FLAGS

    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does it as root)")
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def services_database() -> ServicesDatabase:
    """PostgreSQL + Redis for a services-mode stack: skipped with the reason where they are
    not reachable, a failure under CI (CI=true), which must run them."""
    services = ServicesDatabase()
    if missing := services.available():
        if os.environ.get("CI"):
            pytest.fail(f"services mode must run in CI: {missing}")
        pytest.skip(missing)
    return services
