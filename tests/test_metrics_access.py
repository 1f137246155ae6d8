"""Who may scrape /metrics (issue 52, finding 8): the holder of the scrape token, never an address
a job shares. Jobs of network `host` share the portal host's loopback, so a loopback
allow-list let any project's job read fleet-wide series."""

import os
import stat
import textwrap

import httpx
import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs import metrics
from portal import metricstoken
from portal.management.commands.up import scrape_token_shown
from tests.livestack import LiveStack


@pytest.fixture(autouse=True)
def fresh_totals():
    metrics.reset()


@pytest.fixture
def token_file(settings, tmp_path):
    """No HANGAR_METRICS_TOKEN: the token generated into (this test's) data directory."""
    settings.HANGAR_METRICS_TOKEN = ""
    settings.HANGAR_METRICS_TOKEN_FILE = tmp_path / "metrics_token"
    return settings.HANGAR_METRICS_TOKEN_FILE


def test_a_loopback_scrape_without_the_token_is_refused(client, settings, db):
    settings.HANGAR_METRICS_TOKEN = "s3cret-scrape"
    refused = client.get("/metrics", REMOTE_ADDR="127.0.0.1")
    assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
    assert b"DCGM" not in refused.content and b"hangar_" not in refused.content
    assert client.get("/metrics", REMOTE_ADDR="::1").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic s3cret-scrape").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-scrape")
    assert ok.status_code == 200 and b"hangar_nodes" in ok.content


def test_without_a_configured_token_one_is_generated_and_required(client, token_file, db):
    assert client.get("/metrics").status_code == 401
    assert token_file.exists(), "made by the first scrape where `manage.py up` did not make it"
    token = token_file.read_text().strip()
    assert len(token) >= 40 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    assert metricstoken.ensure() == (token, False), "made once, then read"


def test_up_prints_the_token_only_at_the_start_that_made_it(token_file):
    line = scrape_token_shown()
    token = token_file.read_text().strip()
    assert line.strip() == f"Prometheus scrape token: {token} (kept in {token_file})"
    assert scrape_token_shown() == ""


def test_a_token_file_readable_by_others_is_refused(client, token_file, db):
    metricstoken.ensure()
    os.chmod(token_file, 0o644)
    with pytest.raises(ImproperlyConfigured, match="chmod 600"):
        metricstoken.current()


def test_an_empty_token_file_lets_nobody_in(client, token_file, db):
    """A token file emptied by hand holds no token: none matches it."""
    token_file.write_text("")
    token_file.chmod(0o600)
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer  ").status_code == 401


def test_the_address_allow_list_is_an_operators_opt_in(client, settings, db):
    settings.HANGAR_METRICS_TOKEN = "s3cret-scrape"
    assert settings.HANGAR_METRICS_ALLOW == [], "nothing by default: not loopback"
    settings.HANGAR_METRICS_ALLOW = ["10.0.0.0/8"]
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 401
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
    # Through a proxy on an allowed address, every forwarded client must be allowed too.
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_X_FORWARDED_FOR="203.0.113.9").status_code == 401
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_X_FORWARDED_FOR="10.9.9.9").status_code == 200


def test_the_example_prometheus_config_sends_the_token():
    import yaml
    from django.conf import settings

    config = yaml.safe_load((settings.BASE_DIR / "docs" / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"] and config["rule_files"] == ["alerts.yml"]


PROBE = textwrap.dedent(
    """
    import sys, urllib.error, urllib.request
    print("metrics-probe: running", flush=True)
    try:
        status = urllib.request.urlopen(sys.argv[1], timeout=20).status
    except urllib.error.HTTPError as exc:
        status = exc.code
    print(f"metrics-probe: HTTP {status}", flush=True)
    try:
        open(sys.argv[2]).read()
        print("metrics-probe: token file read", flush=True)
    except OSError as exc:
        print(f"metrics-probe: token file unreadable ({type(exc).__name__})", flush=True)
    """
)


@pytest.mark.e2e
def test_a_job_on_the_portal_host_cannot_scrape_metrics_from_loopback():
    """A real job of the local agent (network `host`: the portal host's loopback) asks for
    /metrics at 127.0.0.1 as the attacker of finding 8 did; the scraper with the token printed
    at first start gets the fleet's series."""
    with LiveStack() as stack:
        printed = [line for line in stack.output().splitlines() if "Prometheus scrape token:" in line]
        assert len(printed) == 1, stack.output()[-3000:]
        token_file = stack.data_dir / "metrics_token"
        token = token_file.read_text().strip()
        assert f"Prometheus scrape token: {token} " in printed[0]
        url = f"{stack.url}/metrics"
        job = stack.submit(["python3", "-c", PROBE, url, str(token_file)], name="metrics-probe")
        stack.wait_for(job["id"], ("succeeded", "failed"), timeout=90)
        lines = [line["text"] for line in stack.api("GET", f"/api/v1/jobs/{job['id']}/logs/").json()["lines"]]
        assert "metrics-probe: running" in lines, (lines, stack.output()[-3000:])
        assert "metrics-probe: HTTP 401" in lines, lines
        if stack.env.get("HANGAR_JOB_UID_RANGE") != "off" and os.geteuid() == 0:
            assert any(line.startswith("metrics-probe: token file unreadable") for line in lines), lines
        scraped = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert (
            scraped.status_code == 200 and "hangar_node_info{" in scraped.text and 'Hostname="node-a"' in scraped.text
        )


def race_for_the_secret(path, rounds: int = 50, racers: int = 4) -> list[list[tuple[str, bool]]]:
    """`racers` processes call secretfile.ensure on one fresh path at the same moment, `rounds` times."""
    import multiprocessing

    from portal import secretfile

    context = multiprocessing.get_context("fork")
    results = []
    for n in range(rounds):
        target = path.with_name(f"{path.name}-{n}")
        barrier, answers = context.Barrier(racers), context.Queue()

        def racer(target=target, barrier=barrier, answers=answers):
            barrier.wait()
            answers.put(secretfile.ensure(target, 32, "a test's secret"))

        procs = [context.Process(target=racer) for _ in range(racers)]
        for proc in procs:
            proc.start()
        results.append([answers.get(timeout=30) for _ in procs])
        for proc in procs:
            proc.join(timeout=30)
    return results


def test_processes_starting_at_once_agree_on_one_secret_and_none_reads_it_half_written(tmp_path):
    """Web, scheduler and agent may start together on a fresh data directory: each must get the
    one secret that stays in the file, and exactly one of them says it made it."""
    rounds = race_for_the_secret(tmp_path / "secret")
    assert len(rounds) == 50
    for n, answers in enumerate(rounds):
        kept = (tmp_path / f"secret-{n}").read_text().strip()
        assert len(kept) >= 40
        assert {value for value, _ in answers} == {kept}, answers
        assert sum(made for _, made in answers) == 1, answers
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"secret-{n}" for n in range(50)), "no temporary left"


def test_an_allowed_network_admits_its_ipv4_mapped_form_and_nothing_else(client, settings, db):
    """A dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d; the webhook check reads them so too."""
    settings.HANGAR_METRICS_TOKEN = "s3cret-scrape"
    settings.HANGAR_METRICS_ALLOW = ["10.0.0.0/8"]
    assert client.get("/metrics", REMOTE_ADDR="::ffff:10.1.2.3").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="::ffff:127.0.0.1").status_code == 401
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_X_FORWARDED_FOR="::ffff:127.0.0.1").status_code == 401
