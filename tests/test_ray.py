"""`launcher: ray` (agent/ray.py, jobs/jobspec.py): the ports a Ray job's ranks use, the
command lines each rank runs, the join check's decision over `ray status`, what the submit
refuses (no ray in the environment, a ray older than the token's minimum, a container, an
unknown launcher), and the rank's own check of the ray its environment has."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from agent import ray
from hangar import cli
from jobs import jobspec
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
    assert a0.dashboard == a1.dashboard == a0.gcs + 1  # the head's dashboard: the attempt's, not Ray's 8265
    own0 = set(vars(a0).values()) - {a0.gcs, a0.dashboard}
    own1 = set(vars(a1).values()) - {a1.gcs, a1.dashboard}
    assert len(own0) == len(own1) == ray.RANK_PORTS and not own0 & own1  # two ranks on one host never meet
    assert a0.dashboard not in own0 | own1
    other = ray.ports(29500 + 8, 29500, 19000, 0)
    assert not set(vars(other).values()) & (own0 | own1 | {a0.gcs, a0.dashboard})
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
    assert f"--dashboard-port={ports.dashboard}" in head
    assert "--num-gpus=2" in head and "--num-cpus=16" in head and "--node-ip-address=10.0.0.11" in head
    assert f"--dashboard-agent-listen-port={ports.dashboard_agent_listen}" in head  # not Ray's fixed 52365
    assert "--temp-dir=/tmp/hangar-ray-3-0-ab" in head
    assert '--resources={"hangar_rank_0": 1}' in head

    p1 = ray.ports(29503, 29500, 19000, 1)
    node = ray.start_argv(1, p1, "10.0.0.11", "10.0.0.12", 0, 8, "/tmp/x")
    assert f"--address=10.0.0.11:{ports.gcs}" in node and "--head" not in node and "--dashboard-port" not in str(node)
    assert f"--node-manager-port={p1.node_manager}" in node and "--node-ip-address=10.0.0.12" in node


def test_rank_zero_runs_the_head_then_the_driver_and_the_others_only_their_node():
    start = ["ray", "start", "--block", "--head"]
    argv = ray.rank_argv(0, start, ["python", "driver.py", "--x"])
    assert argv[:2] == ["python", "-c"] and argv[2] == ray.HEAD_WRAPPER and argv[3] == jobspec.RAY_MINIMUM
    assert argv[4] == ray.GO_FILE and json.loads(argv[5]) == start and argv[6:] == ["python", "driver.py", "--x"]
    node = ray.rank_argv(1, start, ["python", "driver.py"])
    assert node == ["python", "-c", ray.NODE_WRAPPER, jobspec.RAY_MINIMUM, json.dumps(start)]
    for wrapper in (ray.HEAD_WRAPPER, ray.NODE_WRAPPER):
        assert wrapper.startswith(ray.RAY_CHECK)  # every rank checks its ray before starting it
        compile(wrapper, "wrapper", "exec")


def site_with_ray(root: Path, version: str) -> Path:
    """A folder holding a `ray` package of `version`, its _version.py as Ray's wheels have it."""
    (root / "ray").mkdir(parents=True)
    (root / "ray" / "__init__.py").write_text("raise SystemExit('the check must not import ray')\n")
    (root / "ray" / "_version.py").write_text(f'commit = "0" * 40\nversion = "{version}"\n')
    return root


def run_rank(rank: int, site: Path | None, cwd: Path, head: list[str] | None = None) -> subprocess.CompletedProcess:
    """A rank's wrapper, run by this interpreter with `site`'s ray; its Ray node a stand-in that says so."""
    node = head or [sys.executable, "-c", "print('ray node started')"]
    driver = [sys.executable, "-c", "print('driver')"]
    argv = [sys.executable, *ray.rank_argv(rank, node, driver)[1:]]
    env = {"PATH": os.environ["PATH"], **({"PYTHONPATH": str(site)} if site else {})}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("version", ["2.51.1", "2.52.0rc1", "2.9.3", "1.13.0", "2.52.0.dev0", "nightly"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_whose_ray_ignores_the_token_ends_before_starting_it(tmp_path, version, rank):
    done = run_rank(rank, site_with_ray(tmp_path / "site", version), tmp_path)
    assert done.returncode == ray.TOO_OLD, done.stderr
    assert f"ray {version} in this job's environment" in done.stderr and "RAY_AUTH_MODE=token" in done.stderr
    assert f"ask for ray>={jobspec.RAY_MINIMUM}" in done.stderr
    assert "ray node started" not in done.stdout and "driver" not in done.stdout
    assert ray.exit_hint(done.returncode).startswith(f": its ray is older than {jobspec.RAY_MINIMUM}")


@pytest.mark.parametrize("version", ["2.52.0", "2.60.0", "3.0.0.dev0", "2.52.0.post1", "2.52", "10.0.0"])
def test_a_rank_whose_ray_enforces_the_token_starts_its_node(tmp_path, version):
    done = run_rank(1, site_with_ray(tmp_path / "site", version), tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ray node started\n", "")


def test_a_rank_without_ray_ends_saying_what_to_ask_for(tmp_path):
    done = run_rank(1, None, tmp_path)
    assert done.returncode == ray.NO_RAY and "no ray in this job's environment" in done.stderr
    assert f"ray>={jobspec.RAY_MINIMUM}" in done.stderr and ray.exit_hint(ray.NO_RAY)


def test_a_ray_whose_version_cannot_be_read_does_not_start(tmp_path):
    site = site_with_ray(tmp_path / "site", "2.60.0")
    (site / "ray" / "_version.py").unlink()
    done = run_rank(1, site, tmp_path)
    assert done.returncode == ray.TOO_OLD and "ray unreadable in this job's environment" in done.stderr


def test_a_ray_folder_in_the_working_directory_is_not_the_ray_that_starts(tmp_path):
    """`ray start` is a console script: the job's directory is not on its path, so a `ray` folder
    there (a code snapshot's) is not what would run, and cannot vouch for the environment's."""
    work = site_with_ray(tmp_path / "work", "9.9.9")
    old = run_rank(1, site_with_ray(tmp_path / "site", "2.40.0"), work)
    assert old.returncode == ray.TOO_OLD and "ray 2.40.0" in old.stderr
    assert run_rank(1, None, work).returncode == ray.NO_RAY


def test_the_head_wrapper_execs_the_driver_once_told_and_its_exit_is_the_outcome(tmp_path):
    site = site_with_ray(tmp_path / "site", "2.60.0")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site)}
    head = [sys.executable, "-c", "import time; time.sleep(60)"]
    (tmp_path / ray.GO_FILE).touch()  # the agent's word: every node joined
    driver = [sys.executable, "-c", "import sys; print('driver'); sys.exit(7)"]
    argv = [sys.executable, *ray.rank_argv(0, head, driver)[1:]]
    out = tmp_path / "out"
    with open(out, "w") as stdout:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=stdout, start_new_session=True)
    try:
        assert proc.wait(timeout=30) == 7  # the driver's code, while the head still runs in its group
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # what the runner does after the exit
    assert out.read_text() == "driver\n" and not (tmp_path / ray.GO_FILE).exists()

    dead_head = [sys.executable, "-c", "import sys; sys.exit(3)"]
    argv = [sys.executable, *ray.rank_argv(0, dead_head, driver)[1:]]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 3 and "before every node joined" in done.stderr and "driver" not in done.stdout

    marker = tmp_path / "head-started"
    too_old = site_with_ray(tmp_path / "old", "2.51.1")
    done = run_rank(0, too_old, tmp_path, head=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert done.returncode == ray.TOO_OLD and not marker.exists() and "driver" not in done.stdout


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


@pytest.mark.parametrize(
    "text, bound",
    [
        ("ray==2.60.0", "2.60.0"),
        ("ray>=2.52", "2.52"),
        ("ray~=2.51", "2.51"),
        ("ray==2.*", "2"),
        ("ray>2.51,<3", "2.51"),
        ("ray<3", None),
        ("ray!=2.40.0", None),
        ("ray", None),
    ],
)
def test_a_requirements_lower_bound(text, bound):
    assert str(jobspec.lower_bound(Requirement(text)) or "") == (bound or "")


@pytest.mark.parametrize(
    "requirement",
    ["ray==2.51.1", "ray>=2.0", "ray<3", "ray~=2.51", "ray==2.*", "ray>=2.52.0rc1", "ray>2.51", "ray!=2.40"],
)
def test_a_ray_job_that_allows_a_ray_older_than_the_tokens_minimum_is_refused_naming_the_fix(submit, requirement):
    """Ray before 2.52.0 ignores RAY_AUTH_MODE=token: its GCS, raylets and dashboard answer anyone on the node."""
    message = assert_refused(
        submit(launcher="ray", requirements=[requirement]),
        "requirements",
        f"allows a ray older than {jobspec.RAY_MINIMUM}",
        "RAY_AUTH_MODE=token",
        f'ask for "ray>={jobspec.RAY_MINIMUM}"',
    )
    assert message.startswith(str(Requirement(requirement)))


def test_a_ray_requirement_behind_a_marker_is_refused(submit):
    assert_refused(
        submit(launcher="ray", requirements=['ray==2.60.0; python_version < "3.12"']),
        "requirements",
        "installs ray only where its marker holds",
        "(no marker)",
    )


@pytest.mark.parametrize(
    "requirements",
    [["ray==2.52.0"], ["ray>=2.52"], ["ray~=2.60"], ["ray==2.60.*"], ["ray[default]==2.60.0"], ["ray<3", "ray>=2.60"]],
)
def test_a_ray_job_whose_ray_enforces_the_token_is_accepted_as_asked(submit, requirements):
    response = submit(launcher="ray", requirements=requirements)
    assert response.status_code == 201, response.content
    assert response.json()["requirements"] == sorted(str(Requirement(text)) for text in requirements)


@pytest.mark.parametrize(
    "asked, stored",
    [
        (["ray"], ["ray>=2.52.0"]),
        (["ray[default]", "six"], ["ray[default]>=2.52.0", "six"]),
        (["ray", "ray[serve]"], ["ray>=2.52.0", "ray[serve]>=2.52.0"]),
    ],
)
def test_an_unpinned_ray_gets_the_tokens_minimum(submit, asked, stored):
    response = submit(launcher="ray", requirements=asked)
    assert response.status_code == 201, response.content
    assert response.json()["requirements"] == stored == Job.objects.get().requirements


def test_an_environments_ray_counts_and_an_unpinned_one_gets_the_minimum_in_the_jobs_requirements(submit):
    Environment.objects.create(name="ray-any", requirements=["ray"], everywhere=True)
    Environment.objects.create(name="ray-old", requirements=["ray==2.40.0"], everywhere=True)
    Environment.objects.create(name="ray-new", requirements=["ray==2.60.0"], everywhere=True)

    assert_refused(
        submit(launcher="ray", environment="ray-old"),
        "environment",
        "environment ray-old: ray==2.40.0 allows a ray older than 2.52.0",
        '"requirements": ["ray>=2.52.0"]',
    )
    assert submit(launcher="ray", environment="ray-new").json()["requirements"] == []
    response = submit(launcher="ray", environment="ray-any")
    assert response.status_code == 201 and response.json()["requirements"] == ["ray>=2.52.0"]
    assert submit(launcher="ray", environment="ray-any", requirements=["ray==2.60.0"]).status_code == 201


def test_a_job_without_the_ray_launcher_may_ask_for_any_ray(submit):
    response = submit(requirements=["ray==2.40.0"])  # Hangar starts no cluster for it
    assert response.status_code == 201 and response.json()["requirements"] == ["ray==2.40.0"]


def test_a_ray_job_in_a_container_is_refused(submit):
    Environment.objects.create(name="pt", kind="container", image="pytorch:latest", everywhere=True)
    assert_refused(submit(launcher="ray", environment="pt"), "launcher", "container", "drop the environment")


def test_an_unknown_launcher_is_refused(submit):
    assert_refused(submit(launcher="mpirun"), "launcher", '"mpirun" is not a launcher', "ray")
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
    too_old = client.post("/jobs/new/", {**form, "launcher": "ray", "requirements": "ray==2.40.0\n"})
    created = client.post("/jobs/new/", {**form, "launcher": "ray", "requirements": "ray==2.60.0\n"}, follow=True)

    assert "launcher ray needs ray in the job&#x27;s environment" in refused.content.decode()
    assert "ray==2.40.0 allows a ray older than 2.52.0" in too_old.content.decode()
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


def serve_once(reply: bytes) -> tuple[int, list[bytes]]:
    """A one-connection TCP server on loopback that reads the request, then sends `reply`."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def answer():
        with server, server.accept()[0] as conn:
            conn.settimeout(5)
            received.append(conn.recv(65536))
            conn.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    return server.getsockname()[1], received


# What Ray's GCS (gRPC's C core) sent a call without the token, as read off the wire here.
REFUSED = (
    b"\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00}\x01\x05\x00\x00\x00\x01\x88@\x0ccontent-type\x10application/grpc"
    b"\x00\x0bgrpc-status\x0216\x00\x0cgrpc-message>InvalidAuthToken: Authentication token is missing or incorrect"
)


def test_the_agents_tokenless_call_reads_the_gcss_answer():
    port, received = serve_once(REFUSED)
    assert ray.tokenless_status("127.0.0.1", port) == (ray.UNAUTHENTICATED, "grpc-status 16")
    request = received[0]
    assert request.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") and ray.GCS_CALL.encode() in request
    assert b"authorization" not in request  # no token: that is the question asked

    port, _ = serve_once(REFUSED.replace(b"\x0216", b"\x010"))  # an old ray answers the call
    assert ray.tokenless_status("127.0.0.1", port)[0] == 0
    port, _ = serve_once(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    assert ray.tokenless_status("127.0.0.1", port) == (None, "no grpc-status in 28 bytes")
    status, evidence = ray.tokenless_status("127.0.0.1", port, timeout=1)  # nobody listens any more
    assert status is None and "ConnectionRefusedError" in evidence


@pytest.mark.skipif(os.geteuid() != 0, reason="the attack needs a job uid other than the agent's: run as root")
def test_a_job_that_swaps_its_directory_for_a_link_gets_root_to_touch_nothing_there(tmp_path):
    """The agent (root) makes and removes the go file in the job's code directory, which the job
    owns: the job replaces that directory with a link to a root-only folder holding a file of
    the same name. Nothing there is removed, and no go file is made through the link."""
    import shutil
    import tempfile

    job_uid = 299_971
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="hangar-ray-swap-"))  # a job uid can reach it
    try:
        base.chmod(0o711)
        jobdir = base / "7"
        jobdir.mkdir()
        os.chown(jobdir, job_uid, job_uid)
        workdir = jobdir / "code-1-0"
        roots = base / "roots"
        roots.mkdir(mode=0o700)
        kept = roots / ray.GO_FILE
        kept.write_text("root's own")
        swap = (
            f"import os; os.mkdir({str(workdir)!r}); os.rmdir({str(workdir)!r}); "
            f"os.symlink({str(roots)!r}, {str(workdir)!r}); print('swapped', os.getuid())"
        )
        done = subprocess.run(
            ["/usr/bin/python3", "-c", swap],
            user=job_uid,
            group=job_uid,
            extra_groups=[],
            capture_output=True,
            text=True,
        )
        assert done.stdout.split() == ["swapped", str(job_uid)], done.stderr  # the job's own uid did it
        assert workdir.is_symlink()

        ray.clean_up(workdir, str(tmp_path / "no-session"))
        assert kept.read_text() == "root's own"
        kept.unlink()
        with pytest.raises(OSError):
            ray.signal_go(workdir)
        assert not kept.exists()
    finally:
        shutil.rmtree(base)
