"""What an agent advertises and refuses on a fleet of several hosts (the parts that need no second host;
tests/test_multihost.py runs two real hosts in network namespaces)."""

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.utils import timezone

from agent import network
from agent.runner import Runner
from jobs.models import AttemptState
from portal import multihost
from tests.factories import make_attempt, make_job, make_node

REMOTE_BROKER = "redis://10.99.0.1:6379/0"


def test_loopback_names_and_addresses():
    assert multihost.is_loopback("127.0.0.1") and multihost.is_loopback("127.0.1.1") and multihost.is_loopback("::1")
    assert multihost.is_loopback("") and multihost.is_loopback("/var/run/postgresql")  # a Unix socket
    assert not multihost.is_loopback("10.99.0.1")
    assert not multihost.is_loopback("no-such-host.invalid")


def test_a_remote_broker_or_database_makes_this_a_multi_host_fleet(settings):
    assert multihost.remote_services() == []  # the embedded default: everything on this host
    settings.CELERY_BROKER_URL = REMOTE_BROKER
    assert multihost.remote_services() == [("the broker", "10.99.0.1", 6379)]


def test_per_host_defaults_are_refused_on_a_multi_host_fleet_naming_the_setting(settings):
    settings.CELERY_BROKER_URL = REMOTE_BROKER
    settings.SECRET_KEY_GENERATED, settings.HANGAR_SECRETS_KEY = True, []
    settings.HANGAR_MLFLOW, settings.MLFLOW_TRACKING_URI = True, "sqlite:////var/lib/hangar/mlflow.db"
    settings.HANGAR_TRACKING_PROXY_URL = "http://127.0.0.1:8000/api/mlflow"  # the default: jobs on other hosts miss it
    problems = dict(multihost.shared_state_problems())
    assert set(problems) == {"HANGAR_SECRET_KEY", "MLFLOW_TRACKING_URI", "HANGAR_TRACKING_PROXY_URL"}
    assert "this host's loopback" in problems["HANGAR_TRACKING_PROXY_URL"]
    assert "10.99.0.1" in problems["HANGAR_SECRET_KEY"] and "same value on every host" in problems["HANGAR_SECRET_KEY"]

    with pytest.raises(SystemCheckError, match="hangar.E101"):
        call_command("check", deploy=True)
    with pytest.raises(CommandError, match="HANGAR_SECRET_KEY: the broker is on another host"):
        call_command("agent", "--simulate", "--node", "refused")

    settings.SECRET_KEY_GENERATED = False  # HANGAR_SECRET_KEY given
    settings.MLFLOW_TRACKING_URI = "postgresql://mlflow@10.99.0.1/mlflow"
    settings.HANGAR_TRACKING_PROXY_URL = "http://10.99.0.1:8000/api/mlflow"
    assert multihost.shared_state_problems() == []


def test_an_agent_will_not_advertise_loopback_when_the_broker_is_remote(settings):
    settings.CELERY_BROKER_URL = REMOTE_BROKER
    with pytest.raises(network.AddressError, match="loopback address, but the broker is on another host"):
        network.choose("127.0.0.1", "")
    with pytest.raises(network.AddressError, match="no interface 'nosuch0'"):
        network.choose("10.99.0.2", "nosuch0")


def test_the_advertised_address_names_the_interface_the_ranks_use():
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.interface_of("gpu-a") == ""  # a name: gloo is told nothing, the preflight checks it
    address, interface, how = network.choose("", "")
    assert address and how  # detected: the default route's interface here, or loopback without a network
    if not multihost.is_loopback(address):
        assert network.interface_addresses()[interface] == address
    assert network.rank_network_env("eth1") == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert network.rank_network_env("") == {}


def test_master_addr_is_rank_zeros_advertised_address(db, project, owner):
    a = make_node("gpu-a", gpus=1, hostname="gpu-a", address="10.99.0.2", network_interface="veth-a")
    b = make_node("gpu-b", gpus=1, hostname="gpu-b", address="10.99.0.3", network_interface="veth-b")
    job = make_job(project, owner, nodes=2, gpus_per_node=1)
    placement = [
        {"rank": 0, "node_id": a.pk, "node": a.name, "gpus": [0]},
        {"rank": 1, "node_id": b.pk, "node": b.name, "gpus": [0]},
    ]
    attempt = make_attempt(job, a, AttemptState.SCHEDULED, placement=placement)
    env = Runner(attempt, rank=1).job_env()
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "10.99.0.2"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "veth-b"  # rank 1's own node's interface


def test_a_rank_requeued_onto_another_host_is_told_its_checkpoint_stayed_behind(db, project, owner, settings):
    a, b = make_node("gpu-a", gpus=1), make_node("gpu-b", gpus=1)
    job = make_job(project, owner)
    make_attempt(job, a, AttemptState.LOST, running_at=timezone.now())
    second = make_attempt(job, b, AttemptState.SCHEDULED)
    said = Runner(second).checkpoint_left_behind()
    assert "attempt 1 ran rank 0 on gpu-a; its checkpoint directory stayed there" in said and "gpu-b" in said

    settings.HANGAR_CHECKPOINT_ROOT = "/shared/checkpoints"  # storage every node mounts
    assert Runner(second).checkpoint_left_behind() == ""
    assert str(job.checkpoint_dir()) == f"/shared/checkpoints/{job.pk}"
