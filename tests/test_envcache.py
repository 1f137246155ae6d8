"""Cached Python environments (agent/envcache.py): hashing, the requirement rules, eviction, a
killed build, the node's report, the scheduler's warm-cache affinity, and a sandboxed job
reading its environment as its own uid."""

import fcntl
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from django.test import Client

from agent import envcache
from agent.envcache import Cache, Entry, choose_evictions, env_hash, resolver_failure
from fleet.models import CachedEnvironment
from hangar import cli
from jobs import jobspec, scheduler
from jobs.models import Environment, JobEvent
from jobs.models.environment import requirements_key
from jobs.policy import FreeNode, QueuedJob, Request, plan
from tests.factories import api_client, make_job, make_node

BASE_DIR = Path(__file__).resolve().parent.parent

# What uv 0.13 printed here for a package the index does not have.
UV_NOT_FOUND = """  × No solution found when resolving dependencies:
  ╰─▶ Because hangar-nope was not found in the package registry and you require hangar-nope, we can conclude
      that your requirements are unsatisfiable."""


# --- hashing and the rules of a request ------------------------------------------------------


def test_a_requirement_key_ignores_order_and_repeats_but_not_the_python_version():
    key = requirements_key(["six==1.17.0", "attrs"], "3.11")

    assert key == requirements_key(["attrs", "six==1.17.0", "attrs"], "3.11")
    assert key != requirements_key(["attrs", "six==1.17.0"], "3.12")
    assert key != requirements_key(["attrs"], "3.11")
    assert requirements_key([], "3.11") == ""


def test_an_environment_hash_is_of_the_exact_packages_and_the_interpreter():
    ident = "cpython-3.11.7-linux-x86_64"

    assert env_hash(["a==1", "b==2"], ident) == env_hash(["b==2", "a==1"], ident)
    assert env_hash(["a==1", "b==2"], ident) != env_hash(["a==1", "b==3"], ident)
    assert env_hash(["a==1"], ident) != env_hash(["a==1"], "cpython-3.12.1-linux-x86_64")


def test_requirements_are_normalised_from_a_list_or_a_requirements_file():
    text = "# training\nSix>=1.16  # pinned below 2\n\nattrs[tests]\nsix>=1.16\n"

    assert jobspec.parse_requirements(text) == ["attrs[tests]", "six>=1.16"]
    assert jobspec.parse_requirements(["numpy>=2", "Six"]) == ["numpy>=2", "six"]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("six\n-r other.txt", "line 2 ('-r other.txt'): options such as -r"),
        (["six", "--index-url https://evil.example/simple"], "entry 2"),
        ("pkg @ file:///etc/passwd", "direct references (URLs, paths, git) are not accepted"),
        ("git+https://github.com/x/y", "is not a requirement"),
        ("six===", "line 1 ('six===') is not a requirement"),
    ],
)
def test_options_direct_references_and_bad_specifiers_are_refused_naming_the_line(given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        jobspec.parse_requirements(given)


def test_the_package_and_the_resolvers_message_come_from_uvs_error():
    package, message = resolver_failure(UV_NOT_FOUND)

    assert package == "hangar-nope"
    assert message.startswith("No solution found when resolving dependencies: Because hangar-nope was not found")
    assert envcache.failure_reason(UV_NOT_FOUND).startswith("environment build failed: package 'hangar-nope': ")


def test_a_failed_build_is_diagnosed_naming_the_package():
    from jobs.diagnosis import Ending, Line, diagnose

    reason = envcache.failure_reason(UV_NOT_FOUND)
    lines = [Line(1, "[hangar] uv: error: No solution found", stream="system"), Line(2, f"[hangar] {reason}", 0)]

    found = diagnose(lines, Ending(state="failed", failure_class="user", reason=reason))

    assert found.category == "environment" and "hangar-nope" in found.summary and "'hangar-nope'" in found.hint
    assert [e["seq"] for e in found.evidence] == [1]


# --- eviction --------------------------------------------------------------------------------


def test_eviction_takes_the_least_recently_used_until_the_rest_fits():
    entries = [Entry("old", 400, 1.0), Entry("mid", 400, 2.0), Entry("new", 400, 3.0)]

    assert choose_evictions(entries, 1000, keep=set()) == ["old"]
    assert choose_evictions(entries, 500, keep=set()) == ["old", "mid"]
    assert choose_evictions(entries, 500, keep={"old"}) == ["mid", "new"]
    assert choose_evictions(entries, 5000, keep=set()) == []


def fake_entry(store: Cache, hash_: str, size: int, used_at: float, key: str) -> None:
    path = store.dir("envs") / hash_
    path.mkdir()
    (path / envcache.META).write_text(json.dumps({"hash": hash_, "size_bytes": size, "packages": ["six==1.17.0"]}))
    store.remember(key, hash_)
    store.used(hash_, 1)
    os.utime(store.root / "usage" / hash_, (used_at, used_at))


def test_eviction_on_disk_spares_an_environment_a_running_job_holds(tmp_path, settings):
    settings.HANGAR_ENV_CACHE_GB = 1e-6  # 1000 bytes
    store = Cache(tmp_path)
    for number, hash_ in enumerate(["a" * 64, "b" * 64, "c" * 64]):
        fake_entry(store, hash_, 600, 1000.0 + number, f"key-{hash_[0]}")
    held = store.lock("a" * 64)
    fcntl.flock(held, fcntl.LOCK_SH)  # a job runs in the oldest

    gone = envcache.evict(store, keep={"c" * 64})

    assert gone == ["b" * 64]
    assert sorted(p.name for p in (tmp_path / "envs").iterdir()) == ["a" * 64, "c" * 64]
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["key-a", "key-c"]
    os.close(held)


def test_a_waiter_takes_the_environment_its_builder_now_holds_while_it_runs(tmp_path):
    """Two agents of one host share a cache: rank 1 built the environment and runs in it (a
    shared hold for the whole job) while rank 0 of the same attempt waited for the build lock.
    Waiting for it exclusively would never end (rank 1 waits for rank 0): rank 0 takes it built."""
    store, hash_ = Cache(tmp_path), "d" * 64
    builder = store.lock(hash_)
    fcntl.flock(builder, fcntl.LOCK_EX)  # building
    waiter, said = store.lock(hash_), []
    done = threading.Event()
    result = {}

    def wait() -> None:
        complete = functools.partial(store.complete, hash_)
        result["exclusive"] = envcache.wait_exclusive(waiter, hash_, said.append, lambda: True, complete)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    assert not done.wait(0.5)
    assert said == [f"waiting for environment {hash_[:12]}: another job on this node is building it"]
    fake_entry(store, hash_, 600, 1000.0, "key-d")  # the build completes...
    fcntl.flock(builder, fcntl.LOCK_SH)  # ...and its job runs in it
    assert done.wait(5) and result == {"exclusive": False}
    os.close(builder)
    os.close(waiter)


# --- a build killed mid-way -------------------------------------------------------------------

BUILD = """
import os, sys, django
os.environ["DJANGO_SETTINGS_MODULE"] = "portal.settings"
django.setup()
from types import SimpleNamespace
from agent import envcache
job = SimpleNamespace(pk=1, environment=None, requirements=sys.argv[1:], python_version="")
prepared = envcache.prepare(job, lambda text: print(text, flush=True), lambda: True)
print("READY", prepared.path, flush=True)
"""


def build_in_a_process(cache_dir: Path, requirements: list[str]) -> subprocess.Popen:
    env = {**os.environ, "HANGAR_ENV_CACHE_DIR": str(cache_dir), "HANGAR_DATA_DIR": str(cache_dir.parent / "data")}
    env["HANGAR_JOB_UID_RANGE"] = "off"  # no database here: the build's check as a job uid reads registered volumes
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, *requirements],
        cwd=BASE_DIR,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_build_killed_mid_way_leaves_no_cache_entry_and_the_next_build_sweeps_it(tmp_path):
    cache_dir = tmp_path / "envs"
    proc = build_in_a_process(cache_dir, ["six==1.15.0"])
    for line in proc.stdout:
        if line.startswith("building environment"):
            break
    deadline = time.monotonic() + 60
    while not list((cache_dir / "envs").glob(".build-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the agent dies mid-build (its uv with it: PDEATHSIG)
    proc.wait()

    left = list((cache_dir / "envs").iterdir())
    assert left and all(p.name.startswith(".build-") for p in left)  # in progress, never an entry
    assert not any((p / envcache.META).exists() for p in left)

    again = build_in_a_process(cache_dir, ["six==1.15.0"])
    out, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out
    assert "built in" in out  # built anew, not taken from the killed build
    assert [p.name for p in (cache_dir / "envs").iterdir()] == [out.split("READY ")[1].split("/")[-1].strip()]


# --- the node's report, its page, the scheduler -----------------------------------------------


def test_the_agent_reports_its_cached_environments_and_the_node_page_lists_them(db, tmp_path, settings, owner):
    settings.HANGAR_ENV_CACHE_DIR = tmp_path
    node = make_node("node-a")
    fake_entry(Cache(tmp_path), "d" * 64, 2048, time.time(), "key-d")
    envcache._reported.clear()

    envcache.report(node)

    row = CachedEnvironment.objects.get(node=node)
    assert (row.hash, row.keys, row.size_bytes, row.jobs, row.packages) == ("d" * 64, ["key-d"], 2048, 1, 1)
    client = Client()
    client.force_login(owner)
    page = client.get(f"/fleet/nodes/{node.name}/").content.decode()
    assert "Cached environments" in page and "d" * 12 in page and "2.0\xa0KB" in page
    assert "six==1.17.0" not in page  # what another project's jobs asked for is not shown


def free(node_id: int, count: int, cached: frozenset = frozenset()) -> FreeNode:
    return FreeNode(node_id, "H100", list(range(count)), frozenset(), count, cached)


def test_the_policy_prefers_a_node_that_holds_the_environment_when_otherwise_equal():
    job = QueuedJob(1, Request(1, env_key="k"))

    placed = plan([job], [free(1, 4), free(2, 4, frozenset({"k"})), free(3, 4)]).placements

    assert (placed[0].ranks[0][0], placed[0].warm) == (2, [2])


def test_best_fit_still_comes_before_the_warm_cache():
    job = QueuedJob(1, Request(1, env_key="k"))

    placed = plan([job], [free(1, 2), free(2, 4, frozenset({"k"}))]).placements

    assert (placed[0].ranks[0][0], placed[0].warm) == (1, [])


def test_the_pass_places_on_the_warm_node_and_says_so(db, project, owner):
    make_node("node-a", gpus=4)
    warm = make_node("node-b", gpus=4)
    job = make_job(project, owner, requirements=["six"], requirements_key=requirements_key(["six"], ""))
    CachedEnvironment.objects.create(node=warm, hash="e" * 64, keys=[job.requirements_key])

    (attempt,) = scheduler.schedule_pass()

    assert attempt.node == warm
    event = JobEvent.objects.get(job=job, kind="scheduled")
    assert "its environment is cached on node-b" in event.message


# --- the submit --------------------------------------------------------------------------------


def submit(user, **fields):
    body = {"project": "vision", "command": ["python", "train.py"], **fields}
    return api_client(user).post("/api/v1/jobs/", body, format="json")


def test_a_submit_stores_the_requirements_normalised_with_their_key(db, project, owner, node):
    response = submit(owner, requirements="Six>=1.16\n# comment\n", python_version="3.11")

    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["requirements"], body["python_version"]) == (["six>=1.16"], "3.11")
    from jobs.models import Job

    assert Job.objects.get(pk=body["id"]).requirements_key == requirements_key(["six>=1.16"], "3.11")


def test_a_job_in_the_ai_environment_gets_its_requirements_key(db, project, owner, node):
    response = submit(owner, environment="ai")
    from jobs.models import Job

    job = Job.objects.get(pk=response.json()["id"])
    assert job.requirements_key == requirements_key(["torch", "transformers"], "")


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"requirements": "six\n-e ."}, "requirements", "options such as -r, -e or --index-url are not accepted"),
        ({"requirements": [1]}, "requirements", "must be a list of requirement specifiers"),
        ({"requirements": ["six"], "python_version": "py3"}, "python_version", "'py3' is not a Python version"),
        ({"python_version": "3.11"}, "python_version", "a Python version needs requirements"),
        ({"requirements": ["six"], "environment": "img"}, "requirements", "is a container: install packages"),
        ({"requirements": ["six"], "environment": "venv"}, "requirements", "is a host path (/opt/venv)"),
    ],
)
def test_bad_requirements_are_refused_naming_the_field_and_the_fix(db, project, owner, node, fields, field, message):
    Environment.objects.create(name="img", kind="container", image="nvcr.io/x:1", everywhere=True)
    Environment.objects.create(name="venv", path="/opt/venv", everywhere=True)

    response = submit(owner, **fields)

    assert response.status_code == 400
    errors = {e["field"]: e["message"] for e in response.json()["errors"]}
    assert message in errors[field], errors
    from jobs.models import Job

    assert not Job.objects.exists()  # nothing half-created


def test_the_cli_sends_requirements_from_a_file_and_from_pip_flags(tmp_path):
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("six==1.17.0\n")
    args = cli.parser().parse_args(
        ["submit", "-p", "vision", "--requirements", str(reqs), "--pip", "attrs", "--python", "3.11", "--", "python"]
    )

    spec = cli.job_spec(args)

    assert spec["requirements"] == ["six==1.17.0", "attrs"] and spec["python_version"] == "3.11"
    assert spec["command"] == ["python"]


# --- the sandbox: a job uid reads its environment, read-only ----------------------------------

SYSTEM_PYTHON = "/usr/bin/python3"
as_root = pytest.mark.skipif(
    os.getuid() != 0 or not os.path.exists("/usr/bin/bwrap") or not os.path.exists(SYSTEM_PYTHON),
    reason="a sandbox needs root, bubblewrap and a system python3",
)

IN_SANDBOX = """
import os, six, sys
print("uid", os.getuid(), "six", six.__version__, "prefix", sys.prefix, flush=True)
try:
    open(os.path.join(sys.prefix, "planted"), "w")
except OSError as exc:
    print("write refused:", type(exc).__name__, flush=True)
"""


@as_root
@pytest.mark.parametrize("pythons", [[], [SYSTEM_PYTHON]], ids=["the-nodes-default-python", "debians-python"])
def test_a_sandboxed_job_runs_in_its_cached_environment_as_its_own_uid(
    transactional_db, project, owner, settings, pythons
):
    # The node's default Python is pyenv's here, under /root: job uids reach it through the sandbox.
    from agent import runner as execution

    settings.HANGAR_SANDBOX = True
    settings.HANGAR_JOB_UID_RANGE = (200000, 299999)
    settings.HANGAR_ENV_PYTHONS = pythons
    settings.HANGAR_ENV_CACHE_DIR = settings.DATA_DIR / f"envs-test-{uuid.uuid4().hex[:8]}"  # hidden, bound back
    from django.utils import timezone

    from fleet.models import GPU

    GPU.objects.filter(node=make_node("node-a", gpus=1)).update(temperature_c=35, sampled_at=timezone.now())
    make_job(project, owner, command=["python", "-c", IN_SANDBOX], requirements=["six==1.17.0"])
    try:
        (attempt,) = scheduler.schedule_pass()
        execution.run_attempt(attempt.pk)
        attempt.refresh_from_db()
        lines = list(attempt.log_lines.order_by("seq").values_list("text", flat=True))
    finally:
        import shutil

        shutil.rmtree(settings.HANGAR_ENV_CACHE_DIR, ignore_errors=True)
    assert attempt.state == "succeeded", (attempt.reason, lines)
    ran = next(text for text in lines if text.startswith("uid "))
    uid = int(ran.split()[1])  # 200000 + its id, or the next free one (agent/sandbox.py job_uid)
    assert 200000 <= uid <= 299999 and ran.startswith(
        f"uid {uid} six 1.17.0 prefix {settings.HANGAR_ENV_CACHE_DIR}/envs/"
    )
    assert any(t.startswith("write refused:") for t in lines), lines
    assert attempt.environment["python"].startswith("cpython-3.11")


def test_an_admin_defined_cached_environment_follows_the_submits_rules(db):
    from django.core.exceptions import ValidationError

    ray = Environment(name="ray", requirements=["Ray[default]==2.60.0"], everywhere=True)
    ray.full_clean()
    assert ray.cached and ray.requirements == ["ray[default]==2.60.0"]

    with pytest.raises(ValidationError, match="options such as -r"):
        Environment(name="bad", requirements=["-e /srv/code"]).full_clean()


def test_the_form_takes_a_requirements_file_and_the_job_page_shows_them(db, project, owner, node):
    from jobs.models import Job

    client = Client()
    client.force_login(owner)
    form = {"project": "vision", "command": "python train.py", "gpus_per_node": 1, "max_runtime_seconds": 60}

    refused = client.post("/jobs/new/", {**form, "requirements": "six\n--index-url https://x.example/"})
    wanted = {**form, "requirements": "six==1.17.0\n", "python_version": "3.11"}
    created = client.post("/jobs/new/", wanted, follow=True)

    assert "options such as -r, -e or --index-url are not accepted" in refused.content.decode()
    job = Job.objects.get()
    assert (job.requirements, job.python_version) == (["six==1.17.0"], "3.11")
    assert "Requirements" in created.content.decode() and "six==1.17.0" in created.content.decode()


def test_the_cli_status_tells_the_requirements_and_the_environment_an_attempt_ran_in():
    record = {"hash": "f" * 64, "python": "cpython-3.11.7-linux-x86_64", "packages": ["six==1.17.0"], "cached": True}
    attempts = [{"environment": {}}, {"environment": record}]
    job = {"requirements": ["six"], "python_version": "3.11", "attempts": attempts}

    assert cli.describe_environment(job) == [
        "  requires: six (Python 3.11)",
        "  env:      ffffffffffff cpython-3.11.7-linux-x86_64, cached: six==1.17.0",
    ]
    assert cli.describe_environment({"requirements": [], "attempts": []}) == []


# --- an environment is checked before it is offered, and rebuilt on request -----------------


def meta_of(store: Cache, hash_: str) -> dict:
    return json.loads((store.env(hash_) / envcache.META).read_text())


def runnable_entry(store: Cache, hash_: str, interpreter: str, **meta) -> None:
    fake_entry(store, hash_, 10, time.time(), f"key-{hash_[0]}")
    (store.env(hash_) / "bin").mkdir()
    (store.env(hash_) / "bin" / "python").symlink_to(interpreter)
    fields = {**meta_of(store, hash_), "interpreter": interpreter, "checked_as_job": True, **meta}
    (store.env(hash_) / envcache.META).write_text(json.dumps(fields))


def test_a_cached_environment_is_reused_only_for_the_interpreter_it_was_built_from(tmp_path):
    store = Cache(tmp_path)
    runnable_entry(store, "a" * 64, sys.executable)
    runnable_entry(store, "b" * 64, sys.executable, checked_as_job=False)  # built before the check existed

    assert store.usable("a" * 64, sys.executable)
    assert not store.usable("a" * 64, "/usr/bin/python3")  # the operator changed HANGAR_ENV_PYTHONS
    assert not store.usable("b" * 64, sys.executable)
    assert env_hash(["six==1.17.0"], "cpython-3.11.2", "/usr/bin/python3.11") != env_hash(
        ["six==1.17.0"], "cpython-3.11.2", "/opt/other/bin/python3.11"
    )


@as_root
def test_an_environment_whose_python_a_job_uid_cannot_run_is_never_kept(transactional_db, tmp_path, settings):
    settings.HANGAR_SANDBOX, settings.HANGAR_JOB_UID_RANGE = True, (200000, 299999)
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text("#!/bin/sh\necho never\n")
    python.chmod(0o700)  # root's alone: what a job uid meets in an environment built with umask 077
    for path in (tmp_path, env, env / "bin"):
        path.chmod(0o755)

    with pytest.raises(envcache.BuildFailed) as failed:
        envcache.check_as_job(env, "e" * 64)

    assert failed.value.failure_class == "infra"
    assert "a job's uid cannot run its Python on this node" in failed.value.reason
    assert "HANGAR_ENV_PYTHONS" in failed.value.reason


def test_a_rebuild_request_drops_on_each_node_what_it_built_before(db, tmp_path, settings):
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import EnvironmentRebuild

    settings.HANGAR_ENV_CACHE_DIR = tmp_path
    store = Cache(tmp_path)
    before = (timezone.now() - timedelta(minutes=5)).isoformat()
    runnable_entry(store, "a" * 64, sys.executable, environment="ai", built_at=before)
    runnable_entry(store, "b" * 64, sys.executable, environment="other", built_at=before)
    runnable_entry(store, "c" * 64, sys.executable, environment="", built_at=before)
    runnable_entry(store, "d" * 64, sys.executable, environment="ai", built_at=before)
    held = store.lock("d" * 64)
    fcntl.flock(held, fcntl.LOCK_SH)  # a running job holds it: it goes at a later heartbeat
    EnvironmentRebuild.objects.create(target="ai")
    EnvironmentRebuild.objects.create(target="c" * 12)  # a hash prefix, as a node page shows it

    gone = envcache.apply_rebuilds(store)

    assert sorted(gone) == ["a" * 64, "c" * 64]
    assert sorted(p.name for p in (tmp_path / "envs").iterdir()) == ["b" * 64, "d" * 64]
    os.close(held)
    assert envcache.apply_rebuilds(store) == ["d" * 64]
    runnable_entry(store, "a" * 64, sys.executable, environment="ai", built_at=timezone.now().isoformat())
    assert envcache.apply_rebuilds(store) == []  # built after the request: kept


def test_only_operators_ask_every_node_to_rebuild_an_environment(db, owner):
    from django.contrib.auth import get_user_model

    from jobs.models import EnvironmentRebuild

    operator = get_user_model().objects.create_user("operator", password="pw", is_staff=True)

    refused = api_client(owner).post("/api/v1/environments/ai/rebuild/")
    done = api_client(operator).post("/api/v1/environments/ai/rebuild/")
    by_hash = api_client(operator).post("/api/v1/environments/0123abcd/rebuild/")
    unknown = api_client(operator).post("/api/v1/environments/no-such/rebuild/")

    assert refused.status_code == 403
    assert done.status_code == 202 and "within 30 s" in done.json()["message"]
    assert by_hash.status_code == 202
    assert unknown.status_code == 400 and unknown.json()["errors"][0]["field"] == "name"
    assert list(EnvironmentRebuild.objects.values_list("target", flat=True)) == ["0123abcd", "ai"]
    listed = api_client(owner).get("/api/v1/environments/").json()
    assert "ai" in [e["name"] for e in (listed["results"] if isinstance(listed, dict) else listed)]
