"""The isolation sweep: for every endpoint in the OpenAPI schema, a user of another
project (or a token limited to another project) asking for project `lab`'s objects
gets 403 or 404 — never its data — and changes nothing. The same for the websocket."""

import re

import pytest
from django.test import Client

from jobs.models import Job, JobState, PipelineRun, PipelineStage, Snapshot, Sweep
from portal.models import ApiToken, Membership, Role, Volume
from tests.factories import api_client, make_job, make_node, make_snapshot, token_client
from tests.test_access import close_code

MARKER = "lab-secret-marker"
# The fleet is shared by every project: any signed-in user may read its nodes.
SHARED = ("/api/v1/nodes/",)


def schema_operations() -> list[tuple[str, str]]:
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    return [
        (path, method)
        for path, operations in schema["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "patch", "delete")
    ]


@pytest.fixture
def lab(roles, tmp_path):
    node = make_node()
    # lab's code snapshot, named by its job: its hash, its download and its diff are lab's alone.
    snapshot = make_snapshot(roles["lab"], roles["member"], {"train.py": f"print('{MARKER}')"}, tmp_path)
    code = {"snapshot": snapshot.sha256, "branch": MARKER}
    job = make_job(
        roles["lab"],
        roles["member"],
        name=MARKER,
        env={"MARK": MARKER},
        snapshot=snapshot,
        code=code,
        code_diff=MARKER,
        requirements=[MARKER],
    )
    token, _ = ApiToken.issue(roles["member"], MARKER)
    volume = Volume.objects.create(project=roles["lab"], name="data", path=f"/{MARKER}")
    pipeline = PipelineRun.objects.create(project=roles["lab"], submitted_by=roles["member"], name=MARKER)
    PipelineStage.objects.create(run=pipeline, name="only", position=0, job=job)
    sweep = Sweep.objects.create(
        project=roles["lab"], submitted_by=roles["member"], name=MARKER, key=MARKER, base={"command": [MARKER]},
        params=[{"env.MARK": MARKER}], max_parallel=1, objective={"metric": MARKER, "mode": "min"},
    )  # fmt: skip
    return {
        "node": node,
        "job": job,
        "token": token,
        "volume": volume,
        "pipeline": pipeline,
        "sweep": sweep,
        "snapshot": snapshot,
        **roles,
    }


def fill(path: str, lab: dict) -> str:
    ids = {"tokens": lab["token"].pk, "pipelines": lab["pipeline"].pk, "sweeps": lab["sweep"].pk}
    values = {
        "id": ids.get(path.split("/")[3], lab["job"].pk),
        "slug": "lab",
        "project_slug": "lab",
        "username": "lab-member",
        "name": lab["volume"].name if "/volumes/" in path else lab["node"].name,
        "sha256": lab["snapshot"].sha256,
    }
    return re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), path)


def body_for(path: str) -> dict:
    return {
        "project": "lab",
        "command": ["true"],
        "name": "x",
        "username": "lab-outsider",
        "role": "admin",
        "path": "/x",
        "reason": "sweep",
    }


def sweep(client, lab) -> list[str]:
    problems = []
    for path, method in schema_operations():
        if path.startswith(SHARED):
            continue
        url = fill(path, lab)
        query = "?project=lab" if method == "get" and "{" not in path else ""
        response = (
            getattr(client, method)(url + query, body_for(path), format="json")
            if method != "get"
            else client.get(url + query)
        )
        content = response.content.decode()
        if MARKER in content:
            problems.append(f"{method.upper()} {url}: shows lab's data")
        if "{" in path and response.status_code not in (403, 404):
            problems.append(f"{method.upper()} {url}: {response.status_code}, not 403/404")
        if "{" not in path and method != "get" and response.status_code < 400:
            problems.append(f"{method.upper()} {url}: {response.status_code}, accepted")
    return problems


def assert_nothing_changed(lab) -> None:
    assert Job.objects.filter(project=lab["lab"]).count() == 1
    assert PipelineRun.objects.filter(project=lab["lab"]).count() == 1
    assert Job.objects.get(pk=lab["job"].pk).state == JobState.QUEUED
    assert ApiToken.objects.get(pk=lab["token"].pk).revoked_at is None
    assert Volume.objects.filter(pk=lab["volume"].pk).exists()
    assert Sweep.objects.count() == 1 and not Job.objects.filter(sweep__isnull=False).exists()
    assert list(Snapshot.objects.values_list("pk", flat=True)) == [lab["snapshot"].pk]
    assert Snapshot.objects.get().last_referenced_at == lab["snapshot"].last_referenced_at
    assert Membership.objects.filter(project=lab["lab"]).count() == len(Role.values)
    assert not Membership.objects.filter(project=lab["lab"], user=lab["outsider"]).exists()


def test_the_sweep_covers_every_area_of_the_api(db):
    paths = {path for path, _ in schema_operations()}
    for area in ("jobs", "pipelines", "sweeps", "projects", "tokens", "audit", "nodes"):
        assert any(p.startswith(f"/api/v1/{area}/") for p in paths), area


def test_a_user_of_another_project_gets_only_403_or_404(lab):
    assert sweep(api_client(lab["outsider"]), lab) == []
    assert_nothing_changed(lab)


def test_a_token_limited_to_another_project_gets_only_403_or_404(lab):
    # lab's own admin, through a token limited to project `other`.
    Membership.objects.create(project=lab["other"], user=lab["admin"], role=Role.ADMIN)
    assert sweep(token_client(lab["admin"], project=lab["other"]), lab) == []
    assert_nothing_changed(lab)


def test_the_job_pages_answer_404_to_another_project(lab):
    client = Client()
    client.force_login(lab["outsider"])
    job = lab["job"].pk
    for url in (f"/jobs/{job}/", f"/jobs/{job}/status/", f"/api/v1/jobs/{job}/code/"):
        assert client.get(url).status_code == 404
    assert client.post(f"/jobs/{job}/cancel/").status_code == 404
    assert client.get(f"/jobs/sweeps/{lab['sweep'].pk}/").status_code == 404
    for url in ("/", "/jobs/", "/tokens/", "/jobs/sweeps/"):
        assert MARKER not in client.get(url).content.decode()


@pytest.mark.django_db(transaction=True)
def test_the_log_socket_refuses_a_token_limited_to_another_project(roles):
    job = make_job(roles["lab"], roles["member"])
    Membership.objects.create(project=roles["other"], user=roles["admin"], role=Role.ADMIN)
    _, raw = ApiToken.issue(roles["admin"], "ws", project=roles["other"])

    assert close_code(f"/ws/jobs/{job.pk}/logs/", [(b"authorization", f"Bearer {raw}".encode())]) == 4404
