"""End to end: jobs with Python requirements run in a cached environment that uv builds once per
node (real uv, real packages from the index): a second job starts without a build, two at once
build once, a package that does not exist fails the attempt as the user's with a diagnosis."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e

PRINT_SIX = ["python", "-c", "import six, sys; print('six', six.__version__, 'in', sys.prefix)"]
DONE = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LiveStack(data_dir=str(tmp_path_factory.mktemp("envs"))) as stack:
        yield stack


def log_of(stack: LiveStack, job_id: int) -> list[str]:
    return [line["text"] for line in stack.api("GET", f"/api/v1/jobs/{job_id}/logs/").json()["lines"]]


def diagnosis_of(stack: LiveStack, job_id: int) -> dict:
    """The job's diagnosis, stored just after its attempt ended."""
    deadline = time.monotonic() + 15
    while (found := stack.job(job_id)["diagnosis"]) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def builds(lines: list[str]) -> int:
    return sum(1 for text in lines if text.startswith("[hangar] building environment"))


def test_a_job_runs_in_its_environment_and_the_next_one_starts_without_a_build(stack):
    first = stack.submit(PRINT_SIX, requirements=["six==1.17.0"])
    done = stack.wait_for(first["id"], DONE, timeout=180)
    assert done["state"] == "succeeded", log_of(stack, first["id"])
    first_log = log_of(stack, first["id"])
    assert any(text.startswith("six 1.17.0 in ") and "/envs/" in text for text in first_log)
    assert any("built in" in text for text in first_log)

    second = stack.submit(PRINT_SIX, requirements="six==1.17.0\n# the same, as a requirements.txt\n")
    assert stack.wait_for(second["id"], DONE, timeout=120)["state"] == "succeeded"
    second_log = log_of(stack, second["id"])
    assert any("cached on this node: no build" in text for text in second_log)
    assert builds(first_log) + builds(second_log) == 1

    record = stack.job(second["id"])["attempts"][0]["environment"]
    assert record["packages"] == ["six==1.17.0"] and record["cached"] is True and len(record["hash"]) == 64


def test_two_jobs_at_once_with_a_new_environment_build_it_once(stack):
    with ThreadPoolExecutor(2) as pool:
        jobs = list(pool.map(lambda _: stack.submit(PRINT_SIX, requirements=["six==1.16.0"]), range(2)))
    ended = [stack.wait_for(job["id"], DONE, timeout=180) for job in jobs]
    assert [job["state"] for job in ended] == ["succeeded", "succeeded"]
    logs = [log_of(stack, job["id"]) for job in jobs]
    assert sum(builds(lines) for lines in logs) == 1
    assert all(any("six 1.16.0" in text for text in lines) for lines in logs)


def test_a_package_that_does_not_exist_fails_the_attempt_as_the_users_with_a_diagnosis(stack):
    job = stack.submit(PRINT_SIX, requirements=["hangar-no-such-package-xyz"])
    done = stack.wait_for(job["id"], DONE, timeout=120)

    assert (done["state"], done["failure_class"]) == ("failed", "user")
    diagnosis = diagnosis_of(stack, job["id"])
    assert diagnosis["category"] == "environment"
    assert "hangar-no-such-package-xyz" in diagnosis["summary"] and "not found" in diagnosis["summary"]
    assert "hangar-no-such-package-xyz" in diagnosis["hint"]
    assert any(e["text"].startswith("[hangar] uv:") for e in diagnosis["evidence"])


def test_a_job_cancelled_during_its_build_leaves_no_cache_entry(stack):
    job = stack.submit(PRINT_SIX, requirements=["numpy==2.2.6", "six==1.17.0"])
    deadline = time.monotonic() + 120
    while not any(t.startswith("[hangar] building environment") for t in log_of(stack, job["id"])):
        assert time.monotonic() < deadline and stack.job(job["id"])["state"] not in DONE, log_of(stack, job["id"])
        time.sleep(0.05)

    stack.api("POST", f"/api/v1/jobs/{job['id']}/cancel/", json={"reason": "mid-build"})
    done = stack.wait_for(job["id"], DONE, timeout=60)

    assert done["state"] == "cancelled" and not done["attempts"][0]["environment"]
    envs = stack.data_dir / "envs" / "envs"
    built = {p.name for p in envs.iterdir() if not p.name.startswith(".")}
    assert all("numpy==2.2.6" not in (envs / name / "hangar-env.json").read_text() for name in built)
    assert not list(envs.glob(".build-*"))  # the agent killed uv and removed its folder
