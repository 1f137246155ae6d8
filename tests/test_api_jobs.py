"""The jobs API: idempotent submission, the role matrix, tokens' limits, secrets and volumes."""

import pytest

from jobs.models import Job, JobState
from portal.models import AuditEvent, Role, Volume
from tests.factories import api_client, make_attempt, make_job, make_node, make_snapshot, token_client

SUBMIT = {"project": "lab", "command": ["python", "train.py"]}


@pytest.fixture
def gpus(db):
    return make_node()


def submit(client, **fields):
    return client.post("/api/v1/jobs/", {**SUBMIT, **fields}, format="json")


# --- Idempotency ---------------------------------------------------------------


def test_a_retried_submit_with_the_same_key_returns_the_first_job(roles, gpus):
    client = api_client(roles["member"])

    first = client.post("/api/v1/jobs/", SUBMIT, format="json", HTTP_IDEMPOTENCY_KEY="sweep-1")
    again = client.post("/api/v1/jobs/", SUBMIT, format="json", HTTP_IDEMPOTENCY_KEY="sweep-1")

    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 1


def test_the_key_may_come_as_a_field(roles, gpus):
    client = api_client(roles["member"])
    ids = {submit(client, idempotency_key="k").json()["id"] for _ in range(3)}
    assert len(ids) == 1 and Job.objects.get().idempotency_key == "k"


def test_a_key_reused_for_other_code_or_env_is_a_conflict_and_the_same_submit_is_a_replay(roles, gpus, tmp_path):
    """An agent's variants differ in their code snapshot or env, not their command: a key reused
    for another variant must not hand back the first variant's job."""
    client = api_client(roles["member"])
    first = make_snapshot(roles["lab"], roles["member"], {"train.py": "LR = 0.1"}, tmp_path / "a")
    second = make_snapshot(roles["lab"], roles["member"], {"train.py": "LR = 0.2"}, tmp_path / "b")
    job = submit(client, idempotency_key="v1", code={"snapshot": first.sha256}, env={"LR": "0.1"}).json()
    assert "id" in job, job

    again = submit(client, idempotency_key="v1", code={"snapshot": first.sha256}, env={"LR": "0.1"})
    other_code = submit(client, idempotency_key="v1", code={"snapshot": second.sha256}, env={"LR": "0.1"})
    other_env = submit(client, idempotency_key="v1", code={"snapshot": first.sha256}, env={"LR": "0.2"})

    assert again.status_code == 200 and again.json()["id"] == job["id"]
    assert other_code.status_code == 409 and "another code" in other_code.json()["message"]
    assert other_env.status_code == 409 and "another env" in other_env.json()["message"]
    assert Job.objects.count() == 1


def test_a_key_reused_for_another_command_is_a_conflict(roles, gpus):
    client = api_client(roles["member"])
    submit(client, idempotency_key="k")

    response = submit(client, idempotency_key="k", command=["python", "other.py"])

    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_conflict" and "new key" in response.json()["message"]


def test_keys_belong_to_their_user(roles, gpus):
    a = submit(api_client(roles["member"]), idempotency_key="k").json()["id"]
    b = submit(api_client(roles["manager"]), idempotency_key="k").json()["id"]
    assert a != b


def test_header_and_field_must_agree(roles, gpus):
    response = api_client(roles["member"]).post(
        "/api/v1/jobs/", {**SUBMIT, "idempotency_key": "a"}, format="json", HTTP_IDEMPOTENCY_KEY="b"
    )
    assert response.status_code == 400 and response.json()["errors"][0]["field"] == "idempotency_key"


# --- Role matrix ----------------------------------------------------------------


@pytest.mark.parametrize(("role", "allowed"), [("viewer", False), ("member", True), ("manager", True), ("admin", True)])
def test_submit_needs_member_or_above(roles, gpus, role, allowed):
    response = submit(api_client(roles[role]))
    assert response.status_code == (201 if allowed else 400)
    if not allowed:
        assert "no project 'lab' that you can submit to" in response.json()["message"]


@pytest.mark.parametrize("role", Role.values)
def test_every_role_reads_the_projects_jobs(roles, role):
    job = make_job(roles["lab"], roles["member"])
    client = api_client(roles[role])
    assert client.get(f"/api/v1/jobs/{job.pk}/").status_code == 200
    assert client.get(f"/api/v1/jobs/{job.pk}/attempts/").status_code == 200
    assert [j["id"] for j in client.get("/api/v1/jobs/").json()["results"]] == [job.pk]


@pytest.mark.parametrize(
    ("role", "own", "others"),
    [("viewer", None, 403), ("member", 200, 403), ("manager", 200, 200), ("admin", 200, 200)],
)
def test_cancel_own_as_member_any_as_manager(roles, role, own, others):
    client = api_client(roles[role])
    theirs = make_job(roles["lab"], roles["member" if role != "member" else "manager"])
    assert client.post(f"/api/v1/jobs/{theirs.pk}/cancel/").status_code == others
    if own is not None:
        mine = make_job(roles["lab"], roles[role])
        response = client.post(f"/api/v1/jobs/{mine.pk}/cancel/", {"reason": "done"}, format="json")
        assert response.status_code == own and response.json()["state"] == JobState.CANCELLED
        assert AuditEvent.objects.filter(action="job.cancel", target_id=str(mine.pk), reason="done").exists()


def test_outsider_and_anonymous_get_nothing(roles):
    job = make_job(roles["lab"], roles["member"])
    outsider = api_client(roles["outsider"])
    for method, url in [("get", f"/api/v1/jobs/{job.pk}/"), ("post", f"/api/v1/jobs/{job.pk}/cancel/")]:
        assert getattr(outsider, method)(url).status_code == 404
        assert getattr(api_client(), method)(url).status_code == 401
    assert outsider.get("/api/v1/jobs/").json()["results"] == []


def test_resubmit_copies_the_job_as_a_new_one(roles, gpus):
    client = api_client(roles["member"])
    first = submit(client, env={"A": "1"}, secret_env={"TOKEN": "s3cret"}, name="run").json()

    response = client.post(f"/api/v1/jobs/{first['id']}/resubmit/")

    assert response.status_code == 201
    again = Job.objects.get(pk=response.json()["id"])
    assert again.pk != first["id"] and (again.name, again.env, again.secret_env) == (
        "run",
        {"A": "1"},
        {"TOKEN": "s3cret"},
    )
    assert api_client(roles["viewer"]).post(f"/api/v1/jobs/{first['id']}/resubmit/").status_code == 400


def test_attempts_lists_each_try(roles, gpus):
    job = make_job(roles["lab"], roles["member"])
    make_attempt(job, gpus, "running")
    attempts = api_client(roles["viewer"]).get(f"/api/v1/jobs/{job.pk}/attempts/").json()
    assert [(a["number"], a["state"], a["node"]) for a in attempts] == [(1, "running", "node-a")]


def test_list_filters(roles):
    make_job(roles["lab"], roles["member"], name="bert-small")
    make_job(roles["lab"], roles["manager"], name="gpt")
    client = api_client(roles["member"])
    assert [j["name"] for j in client.get("/api/v1/jobs/?submitted_by=me").json()["results"]] == ["bert-small"]
    assert [j["name"] for j in client.get("/api/v1/jobs/?name=gp").json()["results"]] == ["gpt"]
    assert client.get("/api/v1/jobs/?project=other").json()["results"] == []


# --- Tokens' limits -------------------------------------------------------------


def test_a_read_only_token_reads_but_never_writes(roles, gpus):
    job = make_job(roles["lab"], roles["admin"])
    client = token_client(roles["admin"], read_only=True)

    assert client.get(f"/api/v1/jobs/{job.pk}/").status_code == 200
    for response in (submit(client), client.post(f"/api/v1/jobs/{job.pk}/cancel/")):
        assert response.status_code == 403 and "read-only" in response.json()["message"]
    assert Job.objects.count() == 1 and Job.objects.get().state == JobState.QUEUED


def test_a_project_limited_token_sees_only_that_project(roles, gpus):
    from portal.models import Membership

    Membership.objects.create(project=roles["other"], user=roles["member"], role=Role.MEMBER)
    elsewhere = make_job(roles["other"], roles["outsider"])
    here = make_job(roles["lab"], roles["member"])
    client = token_client(roles["member"], project=roles["lab"])

    assert [j["id"] for j in client.get("/api/v1/jobs/").json()["results"]] == [here.pk]
    assert client.get(f"/api/v1/jobs/{elsewhere.pk}/").status_code == 404
    assert [p["slug"] for p in client.get("/api/v1/projects/").json()["results"]] == ["lab"]
    assert submit(client, project="other").status_code == 400
    assert submit(client).status_code == 201


# --- Secrets and volumes ---------------------------------------------------------


def test_secret_env_is_never_shown_back(roles, gpus):
    client = api_client(roles["member"])
    job = submit(client, secret_env={"WANDB_API_KEY": "s3cret-value"}).json()

    shown = client.get(f"/api/v1/jobs/{job['id']}/").content.decode()
    listed = client.get("/api/v1/jobs/").content.decode()

    assert job["secret_env"] == {"WANDB_API_KEY": "********"}
    assert "s3cret-value" not in shown + listed
    assert "s3cret-value" not in str(list(AuditEvent.objects.values()))
    assert Job.objects.get().secret_env == {"WANDB_API_KEY": "s3cret-value"}


def test_secret_and_plain_env_may_not_share_a_name(roles, gpus):
    response = submit(api_client(roles["member"]), env={"A": "1"}, secret_env={"A": "2"})
    assert response.status_code == 400 and response.json()["errors"][0]["field"] == "secret_env"


@pytest.fixture
def volume(roles):
    return Volume.objects.create(project=roles["lab"], name="imagenet", path="/data/imagenet", version="v3")


def test_a_job_gets_the_volumes_its_role_grants(roles, gpus, volume):
    response = submit(api_client(roles["member"]), volumes=[{"name": "imagenet"}])

    assert response.status_code == 201
    assert response.json()["volumes"] == [{"name": "imagenet", "path": "/data/imagenet", "mode": "ro", "version": "v3"}]


def test_read_write_needs_the_write_role(roles, gpus, volume):
    refused = submit(api_client(roles["member"]), volumes=[{"name": "imagenet", "mode": "rw"}])
    assert refused.status_code == 400
    assert refused.json()["errors"][0]["field"] == "volumes[0].name"
    assert "needs the manager role" in refused.json()["message"]
    assert submit(api_client(roles["manager"]), volumes=[{"name": "imagenet", "mode": "rw"}]).status_code == 201


def test_an_unknown_volume_lists_the_known_ones(roles, gpus, volume):
    response = submit(api_client(roles["member"]), volumes=[{"name": "coco"}])
    assert response.status_code == 400 and "its volumes: imagenet" in response.json()["message"]


def test_the_job_environment_has_volumes_and_secrets(roles, gpus, volume):
    from agent.runner import Runner

    client = api_client(roles["member"])
    job = Job.objects.get(pk=submit(client, volumes=[{"name": "imagenet"}], secret_env={"KEY": "v"}).json()["id"])
    attempt = make_attempt(job, gpus, "preflight")

    env = Runner(attempt).job_env()

    assert env["HANGAR_VOLUME_IMAGENET"] == "/data/imagenet" and env["KEY"] == "v"


def test_other_node_types_do_not_matter_for_the_largest_node_message(roles):
    make_node("big", gpus=8, model="B300")
    response = submit(api_client(roles["member"]), gpus_per_node=16, gpu_type="B300")
    assert (
        response.json()["message"]
        == "gpus_per_node: gpus_per_node=16 but the largest B300 node has 8; ask for at most 8"
    )


def test_the_job_page_masks_secrets_and_records_volumes(client, roles, gpus, volume):
    api = api_client(roles["member"])
    job = submit(api, secret_env={"KEY": "s3cret-value"}, volumes=[{"name": "imagenet"}]).json()
    client.force_login(roles["viewer"])

    page = client.get(f"/jobs/{job['id']}/").content.decode()

    assert "s3cret-value" not in page and "KEY=********" in page
    assert "/data/imagenet" in page and "version v3" in page


def test_the_submit_page_takes_secrets_and_never_shows_them_back(client, roles, gpus):
    client.force_login(roles["member"])
    form = {"project": "lab", "command": "python train.py", "gpus_per_node": 1, "priority": "normal"}
    form.update(max_runtime_seconds=60, secret_env="API_KEY=s3cret-value")

    refused = client.post("/jobs/new/", {**form, "gpus_per_node": 64})
    created = client.post("/jobs/new/", form, follow=True)

    assert "s3cret-value" not in refused.content.decode()
    assert Job.objects.get().secret_env == {"API_KEY": "s3cret-value"}
    assert "s3cret-value" not in created.content.decode() and "API_KEY=********" in created.content.decode()


# --- The response's shape ---------------------------------------------------------


def test_the_written_out_job_json_matches_the_declared_fields(roles, gpus):
    from django.utils import timezone
    from rest_framework import serializers

    from jobs.api.serializers import JobSerializer
    from jobs.models import Environment

    environment = Environment.objects.create(name="torch", everywhere=True)
    plain = make_job(roles["lab"], roles["member"])
    full = make_job(
        roles["lab"],
        roles["manager"],
        env={"A": "1"},
        secret_env={"KEY": "v"},
        volumes=[{"name": "x", "path": "/x", "mode": "ro", "version": ""}],
        preemptible=True,
        environment=environment,
        exit_code=3,
        failure_class="user",
        finished_at=timezone.now(),
        config={"lr": 0.1},
        data_refs=["s3://b/k"],
    )
    make_attempt(full, gpus, "failed", exit_code=3, finished_at=timezone.now())
    declared = JobSerializer.Meta.fields

    for job in Job.objects.filter(pk__in=[plain.pk, full.pk]).prefetch_related("attempts__node"):
        written = JobSerializer(job).data
        generic = serializers.ModelSerializer.to_representation(JobSerializer(job), job)
        assert list(written) == declared and written == generic


@pytest.mark.django_db(transaction=True)
def test_node_sizes_are_remembered_outside_a_transaction_until_a_node_is_saved(django_assert_num_queries):
    from django.core.cache import cache

    from fleet.models import Node
    from jobs.api.capacity import NODE_SIZES, node_sizes

    cache.delete(NODE_SIZES)
    try:
        make_node("a", gpus=4)
        assert node_sizes() == [("H100", 4)]
        with django_assert_num_queries(0):
            assert node_sizes() == [("H100", 4)]
        Node.objects.filter(name="a").update(gpu_count=8)  # as an agent's process would: no signal here
        assert node_sizes() == [("H100", 4)]
        make_node("b", gpus=8, model="B300")
        assert sorted(node_sizes()) == [("B300", 8), ("H100", 8)]
    finally:
        cache.delete(NODE_SIZES)


def test_node_sizes_read_inside_a_transaction_are_not_remembered(gpus, django_assert_num_queries):
    from jobs.api.capacity import node_sizes

    assert node_sizes() == [("H100", 4)]
    with django_assert_num_queries(1):
        node_sizes()


def test_submit_fields_keep_nothing_from_one_submit_to_the_next(roles, gpus, volume):
    from jobs.api.serializers import JobSubmitSerializer

    client = api_client(roles["member"])
    wrong = {"command": "ls", "volumes": [{"name": "imagenet", "mode": "xx"}], "env": {"1A": "x"}}

    refused = submit(client, **wrong)
    accepted = submit(client, volumes=[{"name": "imagenet"}], env={"A": "1"})
    refused_again = submit(client, **wrong)

    assert refused.status_code == 400 and refused.json() == refused_again.json()
    assert {e["field"] for e in refused.json()["errors"]} == {"command", "volumes[0].mode", "env"}
    assert accepted.status_code == 201 and accepted.json()["volumes"][0]["mode"] == "ro"
    assert all(field.parent is None for field in JobSubmitSerializer._declared_fields.values())
