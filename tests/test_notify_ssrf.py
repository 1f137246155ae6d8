"""Webhooks as a way into the portal's own network (issue 52, finding 7): every spelling of a
local address is refused at save and at send, the receiver listening there hears nothing, and
the delivery log says "refused: private address" with no remote status. Also: no redirect is
followed, a name is resolved once per send and the connection goes to the address checked,
and a cordon's payload carries another project's printed line to nobody outside it."""

import datetime
import socket
import ssl
import threading
import time

import pytest
from django.test import Client
from django.utils import timezone

from fleet.models import HealthEvent
from jobs import egress, notify, tasks
from jobs.models import AttemptState, Delivery, FailureClass, Subscription
from jobs.models.notify import url_problem
from portal.models import AuditEvent
from tests.factories import api_client, make_attempt, make_job, make_node, make_user
from tests.test_notify import Receiver, verify

PUBLIC = "93.184.215.14"  # a global address, never connected to here (the resolver stands in)


@pytest.fixture
def receivers():
    made = []

    def make(*statuses, **where) -> Receiver:
        made.append(Receiver(statuses, **where))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(autouse=True)
def nothing_allowed(settings):
    settings.HANGAR_WEBHOOK_ALLOW_NETS = []


class Names:
    """A resolver seam (jobs.egress.Resolver): each name answers its addresses in turn, the last
    one for good; every question is counted."""

    def __init__(self, **answers: list[list[str]]):
        self.answers = {name.replace("_", "."): list(seq) for name, seq in answers.items()}
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        seq = self.answers.get(host)
        if seq is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return seq.pop(0) if len(seq) > 1 else seq[0]


def end_a_job(project, owner, name="doomed") -> int:
    """A job of `project` fails; returns the ids of the deliveries it made."""
    job = make_job(project, owner, name=name)
    attempt = make_attempt(job, make_node(f"node-{name}"), AttemptState.RUNNING, started_at=timezone.now())
    attempt.finish(AttemptState.FAILED, FailureClass.USER, "exit code 1", exit_code=1)
    tasks.notify_event("attempt", attempt.pk)
    return list(Delivery.objects.filter(key__startswith=f"job:{job.pk}:").values_list("pk", flat=True))


def local_spellings(v4: Receiver, v6: Receiver) -> list[str]:
    """Every way this machine's loopback can be written in a webhook URL (each reaches a receiver)."""
    p = v4.port
    return [
        f"http://127.0.0.1:{p}/hook",
        f"http://localhost:{p}/hook",
        f"http://[::ffff:127.0.0.1]:{p}/hook",
        f"http://2130706433:{p}/hook",
        f"http://0x7f000001:{p}/hook",
        f"http://127.1:{p}/hook",
        f"http://0.0.0.0:{p}/hook",
        f"http://[::1]:{v6.port}/hook",
    ]


ELSEWHERE = [
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://[fd00:ec2::254]/latest/meta-data/", "cloud metadata"),
    ("http://100.100.100.200/latest/meta-data/", "cloud metadata"),
    ("http://10.0.0.5:5432/", "private"),
    ("http://172.16.3.4/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://100.64.0.1/", "carrier-grade NAT"),
    ("http://169.254.10.10/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://[fc00::1]/", "unique local (ULA)"),
    ("http://224.0.0.251/", "multicast"),
    ("http://[ff02::1]/", "multicast"),
    ("http://[::]/", "unspecified"),
    ("http://[2002:7f00:1::]/", "loopback"),  # 6to4 around 127.0.0.1
    ("http://[64:ff9b::a00:5]/", "NAT64"),
]


def test_every_spelling_of_loopback_is_refused_at_save_api_and_page(receivers, owner, project):
    v4, v6 = receivers(), receivers(host="::1")
    api, page = api_client(owner), Client()
    page.force_login(owner)
    for url in local_spellings(v4, v6):
        made = api.post("/api/v1/subscriptions/", {"events": ["job.failed"], "url": url}, format="json")
        assert made.status_code == 400, (url, made.content)
        (error,) = made.json()["errors"]
        assert error["field"] == "url", (url, error)
        # Either not a URL at all to Django's validator, or refused with the fix named.
        assert "HANGAR_WEBHOOK_ALLOW_NETS" in error["message"] or "valid URL" in error["message"], (url, error)
        shown = page.post("/notifications/", {"events": ["job.failed"], "channel": "webhook", "url": url})
        assert shown.status_code == 200 and shown.context["form"].errors.keys() == {"url"}, url
    assert not Subscription.objects.exists()
    assert v4.got == [] and v6.got == []


def test_a_public_target_is_accepted_and_cannot_be_changed_to_a_local_one(owner, project):
    api, page = api_client(owner), Client()
    made = api.post(
        "/api/v1/subscriptions/", {"events": ["job.failed"], "url": f"https://{PUBLIC}/hook"}, format="json"
    )
    assert made.status_code == 201, made.content
    moved = api.patch(f"/api/v1/subscriptions/{made.json()['id']}/", {"url": "http://[::1]:8000/"}, format="json")
    assert moved.status_code == 400 and moved.json()["errors"][0]["field"] == "url"
    assert api.patch(f"/api/v1/subscriptions/{made.json()['id']}/", {"active": False}, format="json").status_code == 200
    page.force_login(owner)
    shown = page.post("/notifications/", {"events": ["node.cordoned"], "channel": "slack", "url": f"http://{PUBLIC}/"})
    sub = Subscription.objects.get(channel="slack")
    assert sub.url == f"http://{PUBLIC}/" and sub.secret in shown.content.decode(), "its secret, shown once"
    assert sub.secret not in page.get("/notifications/").content.decode()


def test_the_refusal_names_the_address_and_the_fix(owner, project):
    api = api_client(owner)
    made = api.post("/api/v1/subscriptions/", {"events": ["job.failed"], "url": "http://localhost:9/x"}, format="json")
    body = made.json()
    assert body["code"] == "invalid" and body["errors"][0]["field"] == "url"
    message = body["errors"][0]["message"]
    assert "localhost resolves to 127.0.0.1" in message and "loopback" in message
    assert "public" in message and "HANGAR_WEBHOOK_ALLOW_NETS" in message


@pytest.mark.parametrize("url,kind", ELSEWHERE)
def test_private_link_local_and_metadata_addresses_are_refused_at_save(url, kind, owner):
    problem = url_problem("webhook", url)
    assert problem is not None and f"a {kind} address" in problem, problem


def test_a_stored_local_target_is_refused_at_send_and_its_receiver_hears_nothing(receivers, settings, owner, project):
    """Subscriptions saved before this check (or under an allowance since withdrawn): with the
    allowance each spelling reaches the receiver, which proves the attack; without it none does."""
    v4, v6 = receivers(), receivers(host="::1")
    for i, url in enumerate(local_spellings(v4, v6)):
        sub = Subscription.objects.create(user=owner, project=project, events=["job.failed"], url=url)
        settings.HANGAR_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8", "::1/128", "0.0.0.0/32"]
        (reached,) = end_a_job(project, owner, name=f"allowed-{i}")
        assert notify.deliver(reached) == "delivered", (url, Delivery.objects.get(pk=reached).log)
        heard = len(v4.got) + len(v6.got)
        settings.HANGAR_WEBHOOK_ALLOW_NETS = []
        (refused,) = end_a_job(project, owner, name=f"refused-{i}")
        assert notify.deliver(refused) == "failed", url
        assert len(v4.got) + len(v6.got) == heard, f"{url} reached the receiver"
        (entry,) = Delivery.objects.get(pk=refused).log
        assert entry["status"] is None, entry
        assert entry["error"].startswith("refused: private address "), entry
        assert ("(loopback)" in entry["error"]) or ("(unspecified)" in entry["error"]), entry
        sub.delete()


@pytest.mark.parametrize("url,kind", ELSEWHERE[:4])
def test_metadata_and_private_targets_are_refused_at_send_without_connecting(url, kind, owner, project):
    Subscription.objects.create(user=owner, project=project, events=["job.failed"], url=url)
    (pk,) = end_a_job(project, owner)
    assert notify.deliver(pk) == "failed"
    (entry,) = Delivery.objects.get(pk=pk).log
    assert entry["status"] is None and entry["error"].startswith("refused: private address "), entry
    assert f"({kind})" in entry["error"] and entry["ms"] < 1000, entry


def test_a_redirect_from_an_allowed_receiver_to_loopback_is_not_followed(receivers, settings, owner, project):
    """An operator allowed 127.0.0.2 (say, a relay); it answers 307 (which keeps the POST) to
    127.0.0.1, which nobody allowed."""
    target = receivers()
    relay = receivers(host="127.0.0.2", location=target.url)
    settings.HANGAR_WEBHOOK_ALLOW_NETS = ["127.0.0.2/32"]
    Subscription.objects.create(user=owner, project=project, events=["job.failed"], url=relay.url)
    (pk,) = end_a_job(project, owner)
    assert notify.deliver(pk) == "failed"
    assert len(relay.got) == 1 and target.got == []
    (entry,) = Delivery.objects.get(pk=pk).log
    assert "HTTP 307: redirects are not followed" in entry["error"], entry


def test_a_name_that_rebinds_to_loopback_after_the_save_is_refused_at_send(receivers, owner, project):
    """DNS rebinding: hooks.example.test is public when the subscription is saved, then points at
    the portal's own loopback, where a receiver listens."""
    local = receivers()
    names = Names(hooks_example_test=[[PUBLIC], ["127.0.0.1"]])
    url = f"http://hooks.example.test:{local.port}/hook"
    assert url_problem("webhook", url, names) is None, "public at save: accepted"
    Subscription.objects.create(user=owner, project=project, events=["job.failed"], url=url)
    (pk,) = end_a_job(project, owner)
    assert notify.deliver(pk, resolve=names) == "failed"
    assert local.got == []
    (entry,) = Delivery.objects.get(pk=pk).log
    assert entry["status"] is None and entry["error"].startswith("refused: private address 127.0.0.1 (loopback)")
    assert names.asked == ["hooks.example.test", "hooks.example.test"], "once at save, once at the send"


def test_a_send_resolves_once_and_connects_to_the_address_it_checked(receivers, settings, owner, project):
    """A name that answers an allowed address to the check and loopback to any later question: the
    connection goes to the checked one (127.0.0.2, allowed), never to 127.0.0.1 on the same port.
    The name resolves nowhere else, so a second lookup by the HTTP client would fail the send."""
    local = receivers()
    checked = receivers(host="127.0.0.2", port=local.port)
    settings.HANGAR_WEBHOOK_ALLOW_NETS = ["127.0.0.2/32"]
    names = Names(hooks_example_test=[["127.0.0.2"], ["127.0.0.1"]])
    sub = Subscription.objects.create(
        user=owner, project=project, events=["job.failed"], url=f"http://hooks.example.test:{local.port}/hook"
    )
    (pk,) = end_a_job(project, owner)
    assert notify.deliver(pk, resolve=names) == "delivered", Delivery.objects.get(pk=pk).log
    assert names.asked == ["hooks.example.test"]
    assert local.got == [] and len(checked.got) == 1
    headers, body = checked.got[0]
    assert headers["Host"] == f"hooks.example.test:{local.port}", "the Host header keeps the name"
    assert verify(headers, body, sub.secret)["event"] == "job.failed"


def self_signed(tmp_path, name: str) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def test_tls_keeps_the_name_for_sni_and_checks_the_certificate(tmp_path, settings, owner, project):
    """Connected to the checked address, the TLS handshake still names hooks.example.test (SNI),
    and an untrusted certificate fails the try (verification stays on)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*self_signed(tmp_path, "hooks.example.test"))
    sni: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: sni.append(name)
    listener = socket.create_server(("127.0.0.2", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        try:
            context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            pass  # the client refused our certificate
        finally:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    settings.HANGAR_WEBHOOK_ALLOW_NETS = ["127.0.0.2/32"]
    names = Names(hooks_example_test=[["127.0.0.2"]])
    url = f"https://hooks.example.test:{port}/hook"
    Subscription.objects.create(user=owner, project=project, events=["job.failed"], url=url)
    try:
        (pk,) = end_a_job(project, owner)
        assert notify.deliver(pk, resolve=names) == "pending"  # a transient failure: tried again later
    finally:
        thread.join(timeout=10)
        listener.close()
    assert sni == ["hooks.example.test"]
    (entry,) = Delivery.objects.get(pk=pk).log
    assert entry["status"] is None and "CERTIFICATE_VERIFY_FAILED" in entry["error"], entry


@pytest.fixture
def silent_dns(monkeypatch):
    """The system resolver, asked about a name whose servers never answer (a lookup that waits
    until the test ends). Stands in for DNS, which this machine cannot be given for one test."""
    released = threading.Event()

    def never_answers(host, port, *args, **kwargs):
        released.wait(60)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", never_answers)
    yield
    released.set()


def test_a_name_that_never_resolves_holds_the_save_and_the_send_no_longer_than_the_timeout(
    silent_dns, settings, owner, project
):
    settings.HANGAR_WEBHOOK_TIMEOUT_SECONDS = 0.5
    page = Client()
    page.force_login(owner)
    started = time.monotonic()
    shown = page.post("/notifications/", {"events": ["job.failed"], "channel": "webhook", "url": "https://slow.test/"})
    assert time.monotonic() - started < 3
    assert "slow.test does not resolve (no answer within 0.5 s)" in shown.context["form"].errors["url"][0]
    Subscription.objects.create(user=owner, project=project, events=["job.failed"], url="https://slow.test/")
    (pk,) = end_a_job(project, owner)
    started = time.monotonic()
    assert notify.deliver(pk) == "pending", "tried again later: the name may answer then"
    assert time.monotonic() - started < 3
    (entry,) = Delivery.objects.get(pk=pk).log
    assert entry["status"] is None and "no answer within 0.5 s" in entry["error"], entry


SECRET = "loss=0.31 on s3://nlp-private/dataset-v7 NCCL WARN net failed"


def test_a_cordon_webhook_carries_another_projects_printed_line_to_nobody_outside_it(
    receivers, settings, node, owner, project, other_project, outsider
):
    """node-a is cordoned on a line printed by project nlp's job: the owner (vision only) gets
    the cordon without the line, nlp's member with it, as each one's node page shows it."""
    settings.HANGAR_WEBHOOK_ALLOW_NETS = ["127.0.0.1/32"]
    mine, theirs = receivers(), receivers()
    subs = {
        "owner": Subscription.objects.create(user=owner, events=["node.cordoned"], url=mine.url),
        "outsider": Subscription.objects.create(user=outsider, events=["node.cordoned"], url=theirs.url),
    }
    attempt = make_attempt(make_job(other_project, outsider), node, "failed")
    cited = {"source": "output", "kind": "nccl", "line": SECRET, "attempt": attempt.pk, "user": outsider.pk}
    event = HealthEvent.objects.create(
        node=node, attempt=attempt, kind="nccl", severity="critical", message="NCCL warned of a failure",
        evidence={"line": SECRET, "decision": "corroborated", "related_events": [cited]}, action="cordoned",
    )  # fmt: skip
    node.auto_cordon("NCCL warned of a failure", {"health_event": event.pk, **event.evidence})
    audit = AuditEvent.objects.get(action="node.auto_cordon")
    assert tasks.notify_event("node", audit.pk) == 2
    for delivery in Delivery.objects.all():
        assert notify.deliver(delivery.pk) == "delivered"
    (headers, body), (their_headers, their_body) = mine.got[0], theirs.got[0]
    assert SECRET.encode() not in body
    payload = verify(headers, body, subs["owner"].secret)
    evidence = payload["node"]["evidence"]
    assert evidence["job"] == "a job of another project" and "printed by" in evidence["line"]
    (related,) = evidence["related_events"]
    assert related["job"] == "a job of another project" and not {"attempt", "user"} & related.keys()
    assert "NCCL warned of a failure" in payload["summary"], "what happened to the node stays readable"
    theirs_seen = verify(their_headers, their_body, subs["outsider"].secret)["node"]["evidence"]
    assert theirs_seen["line"] == SECRET and theirs_seen["related_events"][0]["attempt"] == attempt.pk
    staff = make_user("operator", is_staff=True)
    assert notify.seen_by(staff, {"node": {"evidence": {"line": SECRET}}})["node"]["evidence"]["line"] == SECRET


def test_egress_refusal_is_a_pure_decision():
    import ipaddress

    assert egress.refusal(ipaddress.ip_address(PUBLIC)) is None
    assert egress.refusal(ipaddress.ip_address("2606:4700:4700::1111")) is None
    assert egress.refusal(ipaddress.ip_address("::ffff:" + PUBLIC)) is None
    assert egress.refusal(ipaddress.ip_address("::ffff:10.0.0.1")) == "private"
    assert egress.refusal(ipaddress.ip_address("169.254.169.254")) == "cloud metadata"
    assert egress.refusal(ipaddress.ip_address("255.255.255.255")) == "reserved"
