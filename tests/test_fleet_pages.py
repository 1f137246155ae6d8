"""Fleet page, node page, the operator API and commands, and the fleet websocket."""

import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from fleet.consumers import FleetConsumer
from fleet.models import GPU, FaultInjection, HealthCheck, HealthEvent, Node, NodeState, TelemetrySample
from jobs.models import AttemptState
from portal.models import AuditEvent
from tests.factories import api_client, make_attempt, make_job, make_node, make_user


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def operator(db):
    return make_user("operator", is_staff=True)


def test_the_fleet_page_shows_nodes_gpus_and_why_a_node_is_out(owner, node):
    GPU.objects.filter(node=node, index=2).update(utilization_pct=91, temperature_c=77, ecc_uncorrected_volatile=3)
    node.cordon(None, "Xid 79 on GPU 2")

    page = browser(owner).get("/fleet/").content.decode()

    assert 'data-node="node-a"' in page
    assert "Cordoned" in page and "Xid 79 on GPU 2" in page
    assert "ECC 3" in page and "4 × H100" in page
    assert "/ws/fleet/" in open("static/js/fleet.js").read()


def test_the_fleet_page_filters_by_state_and_gpu_type(owner):
    make_node("h-1", model="H100")
    make_node("b-1", model="B300").cordon(None, "maintenance")

    by_type = browser(owner).get("/fleet/?gpu=B300").content.decode()
    by_state = browser(owner).get("/fleet/?state=ready").content.decode()

    assert 'data-node="b-1"' in by_type and 'data-node="h-1"' not in by_type
    assert 'data-node="h-1"' in by_state and 'data-node="b-1"' not in by_state


def test_the_fleet_page_costs_the_same_queries_for_many_nodes(owner, django_assert_max_num_queries):
    for i in range(120):
        make_node(f"n-{i:04d}", gpus=8)
    client = browser(owner)

    with django_assert_max_num_queries(12):
        response = client.get("/fleet/?page=2")

    page = response.content.decode()
    assert page.count("data-node=") == 50
    assert 'data-node="n-0050"' in page and "page 2 of 3" in page


def test_the_node_page_charts_telemetry_and_shows_history(owner, outsider, project, other_project, node):
    now = timezone.now()
    TelemetrySample.objects.bulk_create(
        TelemetrySample(node=node, gpu_index=g, at=now - timedelta(seconds=5 * i), utilization_pct=50, temperature_c=60)
        for g in range(4)
        for i in range(100)
    )
    HealthEvent.objects.create(
        node=node, kind="xid", severity="critical", xid=79, message="GPU 1: Xid 79", action="cordoned"
    )
    node.cordon(owner, "bad fan")
    mine = make_attempt(make_job(project, owner, name="mine"), node, AttemptState.RUNNING)
    make_attempt(make_job(other_project, outsider, name="theirs"), node, AttemptState.RUNNING)

    response = browser(owner).get("/fleet/nodes/node-a/?window=1h")

    page = response.content.decode()
    figure = json.loads(response.context["figure"])
    assert len(figure["data"]) == 4 * 5  # a trace per GPU and metric
    assert "plotly.min.js" in page
    assert "GPU 1: Xid 79" in page and "bad fan" in page and "node.cordon" in page
    assert f"{mine.job_id} mine" in page and "theirs" not in page


def test_only_operators_change_nodes(owner, node):
    response = api_client(owner).post("/api/v1/nodes/node-a/cordon/", {"reason": "x"}, format="json")

    assert response.status_code == 403
    assert Node.objects.get().state == NodeState.READY


def test_an_operator_cordons_drains_and_uncordons_with_a_reason(operator, node):
    client = api_client(operator)

    missing = client.post("/api/v1/nodes/node-a/cordon/", {}, format="json")
    assert missing.status_code == 400 and missing.json()["errors"][0]["field"] == "reason"

    cordon = client.post("/api/v1/nodes/node-a/cordon/", {"reason": "fan swap"}, format="json")
    assert cordon.status_code == 200 and cordon.json()["node"]["state"] == "cordoned"
    drain = client.post("/api/v1/nodes/node-a/drain/", {"reason": "let jobs end"}, format="json")
    assert drain.json()["node"]["state"] == "draining"
    back = client.post("/api/v1/nodes/node-a/uncordon/", {"reason": "fixed"}, format="json")
    assert back.json()["node"]["state"] == "ready"

    trail = list(AuditEvent.objects.order_by("at", "id").values_list("action", "reason", "detail"))
    assert [(a, r, d["previous_state"]) for a, r, d in trail if a.startswith("node.")] == [
        ("node.cordon", "fan swap", "ready"),
        ("node.drain", "let jobs end", "cordoned"),
        ("node.uncordon", "fixed", "draining"),
    ]
    assert AuditEvent.objects.filter(action="node.cordon", actor=operator).exists()


def test_a_node_already_in_that_state_is_an_error(operator, node):
    response = api_client(operator).post("/api/v1/nodes/node-a/uncordon/", {"reason": "x"}, format="json")

    assert response.status_code == 400 and "already ready" in response.json()["message"]


def test_faults_are_queued_for_simulated_nodes_only(operator, node):
    client = api_client(operator)

    ok = client.post("/api/v1/nodes/node-a/fault/", {"kind": "xid", "gpu": 1, "xid": 48}, format="json")
    assert ok.status_code == 201
    assert FaultInjection.objects.get().xid == 48
    bad_gpu = client.post("/api/v1/nodes/node-a/fault/", {"kind": "ecc", "gpu": 9}, format="json")
    assert bad_gpu.status_code == 400 and bad_gpu.json()["errors"][0]["field"] == "gpu"

    Node.objects.filter(pk=node.pk).update(simulated=False)
    real = client.post("/api/v1/nodes/node-a/fault/", {"kind": "ecc"}, format="json")
    assert real.status_code == 400 and "simulated" in real.json()["message"]


def test_node_events_and_checks_are_listed(owner, node):
    HealthEvent.objects.create(node=node, kind="nccl", severity="critical", message="NCCL", action="cordoned")

    events = api_client(owner).get("/api/v1/nodes/node-a/events/").json()

    assert [e["kind"] for e in events["results"]] == ["nccl"]
    assert api_client(owner).get("/api/v1/nodes/node-a/checks/").json()["results"] == []
    assert api_client().get("/api/v1/nodes/node-a/events/").status_code == 401


def test_the_operator_page_actions(operator, owner, node):
    client = browser(operator)

    client.post("/fleet/nodes/node-a/action/", {"action": "cordon", "reason": "from the page"})
    assert Node.objects.get().state == NodeState.CORDONED
    client.post("/fleet/nodes/node-a/action/", {"action": "fault", "kind": "thermal", "gpu": "0", "seconds": "5"})
    assert FaultInjection.objects.get().kind == "thermal"
    assert browser(owner).post("/fleet/nodes/node-a/action/", {"action": "uncordon", "reason": "x"}).status_code == 403


def test_manage_py_node_and_inject_fault(operator, node):
    call_command("node", "cordon", "node-a", "--reason", "bad PSU", "--by", "operator")
    assert Node.objects.get().state == NodeState.CORDONED
    assert AuditEvent.objects.get(action="node.cordon").actor == operator

    node.refresh_from_db()
    Node.objects.filter(pk=node.pk).update(auto_cordoned=True)
    call_command("node", "uncordon", "node-a", "--reason", "trust me", "--override")
    assert AuditEvent.objects.filter(action="node.uncordon_override").exists()

    call_command("inject_fault", "node-a", "xid", "--gpu", "2", "--xid", "94")
    assert FaultInjection.objects.get().xid == 94
    with pytest.raises(CommandError, match="no node named"):
        call_command("node", "drain", "nope", "--reason", "x")
    with pytest.raises(CommandError, match="GPU 7 does not exist"):
        call_command("inject_fault", "node-a", "ecc", "--gpu", "7")


def test_the_fleet_websocket_sends_the_pages_nodes(transactional_db, owner):
    make_node("ws-1")
    make_node("ws-2").cordon(None, "maintenance")

    async def talk(user, query):
        # channels.testing needs daphne; asgiref's communicator speaks the same ASGI messages.
        scope = {"type": "websocket", "path": "/ws/fleet/", "query_string": query.encode(), "user": user}
        communicator = ApplicationCommunicator(FleetConsumer.as_asgi(), scope)
        await communicator.send_input({"type": "websocket.connect"})
        first = await communicator.receive_output(timeout=5)
        if first["type"] == "websocket.close":
            return False, first["code"], None
        second = await communicator.receive_output(timeout=5)
        if second["type"] == "websocket.close":  # a refusal: accepted, then closed with its code
            return False, second["code"], None
        message = json.loads(second["text"])
        await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        await communicator.wait(timeout=2)
        return True, None, message

    connected, _, message = async_to_sync(talk)(owner, "state=cordoned")
    assert connected and message["type"] == "nodes"
    assert [(n["name"], n["state"], n["state_reason"]) for n in message["nodes"]] == [
        ("ws-2", "cordoned", "maintenance")
    ]
    assert len(message["nodes"][0]["gpus"]) == 4
    assert message["counts"] == {"ready": 1, "cordoned": 1}

    from django.contrib.auth.models import AnonymousUser

    connected, code, _ = async_to_sync(talk)(AnonymousUser(), "")
    assert not connected and code == 4401


def test_long_windows_are_averaged_per_minute_in_the_database(node):
    from fleet.charts import bucketed

    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(hours=2)
    TelemetrySample.objects.bulk_create(
        TelemetrySample(node=node, gpu_index=0, at=minute + timedelta(seconds=s), utilization_pct=u)
        for s, u in ((5, 10), (25, 20), (45, 60))
    )

    series = bucketed(node, timezone.now() - timedelta(hours=24))

    ((at, util, *_),) = series[0]
    assert at == minute and util == pytest.approx(30)


def test_the_node_page_shows_idle_gpus_evidence_as_a_table_and_failed_checks_first(owner, node):
    GPU.objects.filter(node=node, index=0).update(
        utilization_pct=0, temperature_c=41, power_w=0, sm_clock_mhz=0, sampled_at=timezone.now()
    )
    HealthEvent.objects.create(
        node=node, kind="ecc", severity="critical", message="GPU 0: ECC", action="cordoned",
        evidence={"gpu": 0, "counters": {"volatile": 2}, "decision": "cordon kind"},
    )  # fmt: skip
    HealthCheck.objects.bulk_create(
        [
            HealthCheck(node=node, suite="preflight", name="driver", passed=True, duration_ms=1, evidence="ok")
            for _ in range(40)
        ]
        + [HealthCheck(node=node, suite="preflight", name="ecc", passed=False, duration_ms=1, evidence="2 errors")]
    )

    page = browser(owner).get("/fleet/nodes/node-a/").content.decode()

    row = page.split('<td title="GPU-node-a-0">', 1)[1].split("</tr>", 1)[0]
    assert "<td>0%</td>" in row and "<td>41°C</td>" in row and "<td>0 W</td>" in row
    assert '<table class="kv">' in page and "<th>counters.volatile</th><td>2</td>" in page
    assert "{&#x27;gpu&#x27;" not in page  # no Python dict text
    failed, passed = page.index('id="checks-failed"'), page.index('id="checks-passed"')
    assert failed < passed and "40 passed checks</summary>" in page


def test_uncordon_is_highlighted_only_on_a_node_that_is_not_ready(operator, node):
    page = browser(operator).get("/fleet/nodes/node-a/").content.decode()
    assert 'value="uncordon">Uncordon' in page and 'value="uncordon" class="primary"' not in page

    node.cordon(operator, "fan")
    page = browser(operator).get("/fleet/nodes/node-a/").content.decode()
    assert 'value="uncordon" class="primary">Uncordon' in page
