"""`launcher: ray` (agent/ray.py, jobs/jobspec.py): the ports a Ray job's ranks use, the
command lines each rank runs, the join check's decision over `ray status`, and what the submit
refuses (no ray in the environment, a container, an unknown launcher)."""

import json
import os
import signal
import time

import pytest

from agent import ray
from hangar import cli
from jobs.models import Environment, Job, Launcher
from tests.factories import api_client
from tests.test_submit_validation import MISSING, assert_refused

URL = "/api/v1/jobs/"

# `ray status` of a 2.60 cluster whose rank 1 joined (as printed here, trimmed).
TWO_NODES = """\
======== Autoscaler status: 2026-12-01 12:19:20.775886 ========
Node status
---------------------------------------------------------------
Active:
 1 node_600102cf8d5fa6fd8f3196c46dfaaebc0163c343bda7ab870140d24c
 1 node_3d63efa8b30875d397ced1706aace40324c2b35e2e9f63c152ac2114
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/2.0 CPU
 0.0/2.0 GPU
 0.0/1.0 hangar_rank_0
 0.0/1.0 hangar_rank_1
 0B/31.95GiB memory
"""
HEAD_ONLY = TWO_NODES.replace(" 1 node_3d63efa8b30875d397ced1706aace40324c2b35e2e9f63c152ac2114\n", "").replace(
    " 0.0/1.0 hangar_rank_1\n", ""
)


def test_each_attempt_has_its_own_block_and_each_rank_its_own_ports():
    a0, a1 = ray.ports(29500 + 7, 29500, 19000, 0), ray.ports(29500 + 7, 29500, 19000, 1)
    assert a0.gcs == a1.gcs == 19000 + 7 * 100  # every rank meets the head on one port
    own0 = set(vars(a0).values()) - {a0.gcs}
    own1 = set(vars(a1).values()) - {a1.gcs}
    assert len(own0) == len(own1) == ray.RANK_PORTS and not own0 & own1  # two ranks on one host never meet
    other = ray.ports(29500 + 8, 29500, 19000, 0)
    assert not set(vars(other).values()) & (own0 | own1 | {a0.gcs})
    # An attempt id mod 1000 past 99 wraps onto the same 100 blocks; every port stays in the range.
    low, high = ray.port_range(19000)
    assert (low, high) == (19000, 28999)
    for master in (29500, 29599, 29600, 30499):
        for rank in (0, 1, 14, 15, 63):
            assert all(low <= port <= high for port in vars(ray.ports(master, 29500, 19000, rank)).values())
    assert ray.ports(29500 + 123, 29500, 19000, 0) == ray.ports(29500 + 23, 29500, 19000, 0)


def test_the_head_and_a_joining_node_start_with_their_ports_gpus_and_cpus():
    ports = ray.ports(29503, 29500, 19000, 0)
    head = ray.start_argv(0, ports, "10.0.0.11", "10.0.0.11", 2, 16, "/tmp/hangar-ray-3-0-ab")
    assert head[:4] == ["ray", "start", "--block", "--disable-usage-stats"]
    assert "--head" in head and f"--port={ports.gcs}" in head and "--include-dashboard=false" in head
    assert "--num-gpus=2" in head and "--num-cpus=16" in head and "--node-ip-address=10.0.0.11" in head
    assert f"--dashboard-agent-listen-port={ports.dashboard_agent_listen}" in head  # not Ray's fixed 52365
    assert "--temp-dir=/tmp/hangar-ray-3-0-ab" in head
    assert '--resources={"hangar_rank_0": 1}' in head

    p1 = ray.ports(29503, 29500, 19000, 1)
    node = ray.start_argv(1, p1, "10.0.0.11", "10.0.0.12", 0, 8, "/tmp/x")
    assert f"--address=10.0.0.11:{ports.gcs}" in node and "--head" not in node
    assert f"--node-manager-port={p1.node_manager}" in node and "--node-ip-address=10.0.0.12" in node


def test_rank_zero_runs_the_head_then_the_driver_and_the_others_only_their_node():
    start = ["ray", "start", "--block", "--head"]
    argv = ray.rank_argv(0, start, ["python", "driver.py", "--x"])
    assert argv[:2] == ["python", "-c"] and argv[2] == ray.HEAD_WRAPPER
    assert argv[3] == ray.GO_FILE and json.loads(argv[4]) == start and argv[5:] == ["python", "driver.py", "--x"]
    assert ray.rank_argv(1, start, ["python", "driver.py"]) == start
    compile(ray.HEAD_WRAPPER, "wrapper", "exec")


def test_the_head_wrapper_execs_the_driver_once_told_and_its_exit_is_the_outcome(tmp_path):
    import subprocess
    import sys

    head = [sys.executable, "-c", "import time; time.sleep(60)"]
    (tmp_path / ray.GO_FILE).touch()  # the agent's word: every node joined
    driver = [sys.executable, "-c", "import sys; print('driver'); sys.exit(7)"]
    argv = [sys.executable, *ray.rank_argv(0, head, driver)[1:]]
    out = tmp_path / "out"
    with open(out, "w") as stdout:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=stdout, start_new_session=True)
    try:
        assert proc.wait(timeout=30) == 7  # the driver's code, while the head still runs in its group
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # what the runner does after the exit
    assert out.read_text() == "driver\n" and not (tmp_path / ray.GO_FILE).exists()

    dead_head = [sys.executable, "-c", "import sys; sys.exit(3)"]
    argv = [sys.executable, *ray.rank_argv(0, dead_head, driver)[1:]]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 3 and "before every node joined" in done.stderr and "driver" not in done.stdout


def test_the_cluster_variables_and_the_token_of_an_attempt():
    token = ray.auth_token("k" * 50, 12)
    assert token == ray.auth_token("k" * 50, 12) != ray.auth_token("k" * 50, 13) != ray.auth_token("j" * 50, 12)
    env = ray.ray_env(token, "10.0.0.11", ray.ports(29512, 29500, 19000, 0))
    assert env["RAY_ADDRESS"] == "10.0.0.11:20200" and env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN"] == token and env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert len(ray.temp_dir(12, 1, token)) < 40  # Ray's sockets go under it (a 107-byte limit)


def test_a_rank_offers_ray_the_cpus_that_go_with_its_gpus():
    assert ray.cpu_share(64, 2, 8) == 16
    assert ray.cpu_share(64, 0, 8) == 64  # a CPU-only rank: the node's
    assert ray.cpu_share(4, 1, 0) == 4  # a node without GPUs
    assert ray.cpu_share(2, 1, 8) == 1


def test_ray_status_counts_active_nodes_and_names_the_ranks_that_joined():
    assert ray.active_nodes(TWO_NODES) == 2 and ray.joined_ranks(TWO_NODES) == {0, 1}
    assert ray.active_nodes(HEAD_ONLY) == 1 and ray.joined_ranks(HEAD_ONLY) == {0}
    assert ray.active_nodes("") == 0 and ray.joined_ranks("") == set()


def test_the_join_check_waits_then_passes_or_fails_with_evidence():
    assert ray.join_decision(2, 2, 12.3, 120, "") == ray.Join(True, True, "2 of 2 Ray nodes joined in 12.3 s")
    assert not ray.join_decision(1, 2, 30, 120, "").done
    late = ray.join_decision(1, 2, 121, 120, "")
    assert (late.done, late.passed) == (True, False) and late.evidence == "only 1 of 2 Ray nodes joined within 120 s"
    dead = ray.join_decision(0, 2, 121, 120, "exit code 1: Timed out while waiting for GCS")
    assert not dead.passed and dead.evidence.startswith("the head never answered within 120 s; last ray status: ")


def test_the_cli_flag_asks_for_the_ray_launcher():
    args = cli.parser().parse_args(["submit", "--ray", "--nodes", "2", "--pip", "ray==2.60.0", "--", "python"])
    spec = cli.job_spec(args)
    assert spec["launcher"] == "ray" and spec["requirements"] == ["ray==2.60.0"] and spec["nodes"] == 2
    assert "launcher" not in cli.job_spec(cli.parser().parse_args(["submit", "--", "python"]))


@pytest.fixture
def submit(owner, project, node):
    client = api_client(owner)

    def post(**fields):
        body = {"project": "vision", "command": ["python", "driver.py"], **fields}
        return client.post(URL, {k: v for k, v in body.items() if v is not MISSING}, format="json")

    return post


def test_a_ray_job_with_ray_in_its_requirements_or_environment_is_accepted(submit):
    response = submit(launcher="ray", requirements=["ray[default]==2.60.0"], nodes=1)
    assert response.status_code == 201, response.content
    assert response.json()["launcher"] == "ray" and Job.objects.get().launcher == Launcher.RAY
    Environment.objects.create(name="ray", requirements=["ray==2.60.0"], everywhere=True)
    assert submit(launcher="ray", environment="ray").status_code == 201
    assert submit().json()["launcher"] == ""


def test_a_ray_job_without_ray_is_refused_naming_the_fix(submit):
    assert_refused(submit(launcher="ray"), "launcher", "needs ray", '"requirements": ["ray==2.60.0"]')
    assert_refused(submit(launcher="ray", requirements=["six"]), "launcher", "needs ray")
    assert_refused(submit(launcher="ray", requirements=["ray-lightning"]), "launcher", "needs ray")


def test_a_ray_job_in_a_container_is_refused(submit):
    Environment.objects.create(name="pt", kind="container", image="pytorch:latest", everywhere=True)
    assert_refused(submit(launcher="ray", environment="pt"), "launcher", "container", "drop the environment")


def test_an_unknown_launcher_is_refused(submit):
    assert_refused(submit(launcher="torchrun"), "launcher", '"torchrun" is not a launcher', "ray")
    assert_refused(submit(launcher=["ray"]), "launcher")


def test_a_ray_job_in_a_project_without_network_is_refused(submit, project):
    project.network = "none"
    project.save(update_fields=["network"])
    assert_refused(submit(launcher="ray", requirements=["ray==2.60.0"]), "launcher", "network host")


def test_the_form_asks_for_the_ray_launcher_and_the_job_page_shows_it(project, owner, node):
    from django.test import Client

    client = Client()
    client.force_login(owner)
    form = {"project": "vision", "command": "python driver.py", "gpus_per_node": 1, "max_runtime_seconds": 60}

    refused = client.post("/jobs/new/", {**form, "launcher": "ray"})
    created = client.post("/jobs/new/", {**form, "launcher": "ray", "requirements": "ray==2.60.0\n"}, follow=True)

    assert "launcher ray needs ray in the job&#x27;s environment" in refused.content.decode()
    assert Job.objects.get().launcher == Launcher.RAY
    page = created.content.decode()
    assert "Launcher" in page and "rank 0 runs the command as the driver" in page


def test_the_join_watchers_lines_give_the_alive_nodes_and_their_ranks():
    assert ray.watched('{"alive": 2, "ranks": [0, 1]}') == (2, {0, 1}, "")
    assert ray.watched('{"error": "RpcError: unavailable"}') == (0, set(), "RpcError: unavailable")
    assert ray.watched("Traceback (most recent")[2].startswith("unreadable: ")
    compile(ray.JOIN_WATCHER, "watcher", "exec")


def test_a_watch_without_gcsclient_falls_back_to_ray_status_and_says_why(tmp_path):
    import sys

    # This interpreter has no ray: the watcher exits saying so, `ray status` is not there either.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    watch = ray.Watch(bin_dir, {"PATH": "/usr/bin:/bin"}, "127.0.0.1:1")
    try:
        deadline = time.monotonic() + 30
        while not watch.fallback and time.monotonic() < deadline:
            seen, ranks, error = watch.look(1.0)
        assert watch.fallback and (seen, ranks) == (0, set())
        assert "FileNotFoundError" in error and "/bin/ray" in error
    finally:
        watch.close()


@pytest.fixture
def ray_attempt(transactional_db, project, owner, settings, tmp_path):
    from fleet.models import GPU
    from jobs import scheduler
    from tests.factories import make_job, make_node

    settings.HANGAR_JOB_WORKDIR = tmp_path
    for name in ("node-a", "node-b"):
        GPU.objects.filter(node=make_node(name, gpus=1, hostname="127.0.0.1")).update(temperature_c=35)
    make_job(project, owner, nodes=2, gpus_per_node=1, launcher="ray", requirements=["ray==2.60.0"])
    (attempt,) = scheduler.schedule_pass()
    (tmp_path / str(attempt.job_id)).mkdir()
    return attempt


def test_a_cluster_that_formed_is_recorded_and_lets_the_driver_start(ray_attempt, tmp_path):
    from agent.runner import Runner
    from fleet.models import HealthCheck

    runner = Runner(ray_attempt, 0)
    runner.ray_joined(ray.Join(True, True, "2 of 2 Ray nodes joined in 9.1 s"), "127.0.0.1:19000", {0, 1}, 9.1)

    assert (tmp_path / str(ray_attempt.job_id) / ray.GO_FILE).exists() and runner.ray_driver_started
    check = HealthCheck.objects.get(attempt_id=ray_attempt.pk, name="ray-join")
    assert check.passed and check.evidence == "2 of 2 Ray nodes joined in 9.1 s" and runner.stop_requested is None


@pytest.mark.parametrize("joined", [{0}, set()])  # a rank missing; the head unanswered
def test_a_cluster_that_did_not_form_fails_the_attempt_as_infra_and_makes_no_node_a_suspect(ray_attempt, joined):
    """The join is what the job's own ray did and reported (its watcher runs the job's environment):
    it fails the attempt, but is no evidence against a node (a job could fail it on purpose, twice,
    to cordon a healthy one). The nodes' reachability is the rendezvous check's."""
    from agent.runner import Runner
    from fleet.models import HealthCheck, HealthEvent

    runner = Runner(ray_attempt, 0)
    evidence = "only 1 of 2 Ray nodes joined within 120 s" if joined else "the head never answered within 120 s"
    runner.ray_joined(ray.Join(True, False, evidence), "127.0.0.1:19000", joined, 120.0)

    check = HealthCheck.objects.get(attempt_id=ray_attempt.pk, name="ray-join")
    assert not check.passed and check.evidence == evidence
    assert not HealthEvent.objects.filter(attempt_id=ray_attempt.pk).exists()
    stop = runner.stop_requested
    assert stop.failure_class == "infra" and evidence in stop.reason and "suspect" not in stop.reason
    assert ("missing: rank 1" in stop.reason) == bool(joined)
    assert not runner.ray_driver_started


def test_the_join_watcher_and_its_ray_status_fallback_run_as_the_job(tmp_path):
    """Both run the job's environment's python and ray (its packages: its code), so never as the agent."""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)  # no ray here: the watcher exits, the fallback runs
    confined = []

    def as_job(argv, env):
        confined.append(argv[0])
        return ["env", "HANGAR_CONFINED=1", *argv], env, {}

    watch = ray.Watch(bin_dir, {"PATH": "/usr/bin:/bin"}, "127.0.0.1:1", as_job)
    try:
        deadline = time.monotonic() + 30
        while not watch.fallback and time.monotonic() < deadline:
            watch.look(1.0)
        assert watch.proc.args[:2] == ["env", "HANGAR_CONFINED=1"]
    finally:
        watch.close()
    assert confined == [str(bin_dir / "python"), str(bin_dir / "ray")]
