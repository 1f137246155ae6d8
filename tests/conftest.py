"""Shared test data: an owner, a teammate and an outsider, and the projects they belong to."""

import os

import pytest

from portal.models import Role
from tests.factories import make_node, make_project, make_user

# The suite runs as users do: as root, every job in its sandbox as a uid of its own (the
# default). A test whose subject is isolation being off turns it off itself.
os.environ.setdefault("HANGAR_SANDBOX", "on")
os.environ.setdefault("HANGAR_JOB_UID_RANGE", "200000-299999")


JOB_IDS_PER_WORKER = 10_000  # a worker makes fewer; the uid range (100,000) holds ten workers


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """Each test worker (pytest-xdist) numbers its jobs from an offset of its own. A sandboxed
    job's uid is 200000 + its id (agent/sandbox.py: job_uid), the workers' databases hand out
    the same ids, and a uid held by a job of one worker made the same job of the other take the
    next one: a test that expected its own failed, now and then."""
    from django.db import connection

    offset = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) * JOB_IDS_PER_WORKER
    if not offset:
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("UPDATE sqlite_sequence SET seq = %s WHERE name = 'jobs_job'", [offset])
            if cursor.rowcount == 0:
                cursor.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('jobs_job', %s)", [offset])
        else:
            cursor.execute("SELECT setval(pg_get_serial_sequence('jobs_job', 'id'), %s)", [offset])


@pytest.fixture(autouse=True)
def no_isolation_unless_asked(settings):
    settings.HANGAR_SANDBOX = os.environ["HANGAR_SANDBOX"] not in ("off", "0", "false", "no")
    settings.HANGAR_JOB_UID_RANGE = None if os.environ["HANGAR_JOB_UID_RANGE"] == "off" else (200000, 299999)


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


@pytest.fixture
def roles(db) -> dict:
    """One user per role in project `lab`, and an outsider who is only in project `other`."""
    users = {role: make_user(f"lab-{role}") for role in Role.values}
    users["lab"] = make_project("lab", **{role: users[role] for role in Role.values})
    users["outsider"] = make_user("lab-outsider")
    users["other"] = make_project("other", **{Role.ADMIN: users["outsider"]})
    return users


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by Playwright (one per test module: Playwright's sync API holds an
    event loop while it lives); missing Chromium fails under CI, skips elsewhere."""
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
