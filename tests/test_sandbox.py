"""One sandbox per job (agent/sandbox.py): the argv as a table, then real jobs run as real
uids inside real bubblewrap (as root), trying what the attacks of issue 15 tried."""

import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from django.utils import timezone

from agent import runner as execution
from agent.sandbox import (
    Bind,
    Launch,
    Sandbox,
    Tools,
    bwrap_argv,
    gpu_devices,
    hidden_mounts,
    init_pid,
    isolation,
    job_uid,
    leader_argv,
    prepare_node,
    tools,
)
from fleet.models import GPU
from jobs import scheduler
from jobs.models import AttemptState, Environment, EnvironmentKind, Job, LogLine
from portal.models import Volume
from tests.factories import api_client, make_job, make_node
from tests.processes import alive, processes_of

as_root = pytest.mark.skipif(
    os.getuid() != 0 or not shutil.which("bwrap"), reason="a sandbox needs the agent to run as root, and bubblewrap"
)


# --- the pure parts ------------------------------------------------------------------


def test_a_jobs_uid_comes_from_its_id_and_is_the_same_for_every_attempt():
    assert job_uid(7, (200000, 299999), set()) == 200007
    assert job_uid(100007, (200000, 299999), set()) == 200007
    assert job_uid(7, (200000, 299999), {0, 1000}) == 200007


def test_a_uid_held_by_another_live_job_is_skipped():
    assert job_uid(7, (200000, 299999), {200007}) == 200008
    assert job_uid(9, (200000, 200009), {200009}) == 200000  # wraps around within the range
    with pytest.raises(OSError, match="every uid of HANGAR_JOB_UID_RANGE 200000-200001 is in use"):
        job_uid(1, (200000, 200001), {200000, 200001})


def box(**fields) -> Sandbox:
    defaults = {"uid": 200007, "workdir": "/var/hangar/jobs/7", "checkpoint_dir": "/var/hangar/jobs/7/checkpoints"}
    return Sandbox(**{**defaults, **fields})


def test_the_sandbox_argv_drops_to_the_uid_then_makes_the_namespaces():
    argv = bwrap_argv(box(hidden=("/var/hangar", "/var/hangar/jobs", "/var/hangar/log-spool")), ["python", "t.py"])

    assert argv == [
        "setpriv", "--reuid=200007", "--regid=200007", "--clear-groups", "--no-new-privs", "--pdeathsig", "KILL", "--",
        "bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session",
        "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--tmpfs", "/var/hangar",
        "--bind", "/var/hangar/jobs/7", "/var/hangar/jobs/7",
        "--remount-ro", "/var/hangar",
        "--chdir", "/var/hangar/jobs/7", "--", "python", "t.py",
    ]  # fmt: skip
    told = bwrap_argv(box(), ["true"], info_fd=9)  # where bwrap writes its init's pid (the job's process group)
    assert told[told.index("--new-session") : told.index("--new-session") + 3] == ["--new-session", "--info-fd", "9"]


@pytest.mark.parametrize(
    "fields, present, absent",
    [
        ({"network": "none"}, ["--unshare-net"], []),
        ({"network": "host"}, [], ["--unshare-net"]),
        (
            {"binds": (Bind("/data/imagenet"), Bind("/data/out", writable=True))},
            ["--ro-bind /data/imagenet /data/imagenet", "--bind /data/out /data/out"],
            [],
        ),
        (
            {"gpus": (3, 1), "real_gpus": True},
            [
                "--dev-bind-try /dev/nvidia1 /dev/nvidia1",
                "--dev-bind-try /dev/nvidia3 /dev/nvidia3",
                "--dev-bind-try /dev/nvidiactl /dev/nvidiactl",
                "--dev-bind-try /dev/nvidia-uvm /dev/nvidia-uvm",
                "--dev-bind-try /dev/nvidia-uvm-tools /dev/nvidia-uvm-tools",
                "--dev-bind-try /dev/nvidia-modeset /dev/nvidia-modeset",
            ],
            ["/dev/nvidia0", "/dev/nvidia2"],
        ),
        ({"gpus": (0,), "real_gpus": False}, [], ["/dev/nvidia0", "/dev/nvidiactl"]),
        ({"checkpoint_dir": "/ckpt/7"}, ["--bind /ckpt/7 /ckpt/7"], []),
    ],
)
def test_the_sandbox_argv(fields, present, absent):
    line = " ".join(bwrap_argv(box(**fields), ["true"]))

    for part in present:
        assert part in line
    for part in absent:
        assert part not in line
    assert "--privileged" not in line and "--uid" not in line.split(" -- ")[0].replace("--reuid", "")


def test_only_the_assigned_gpus_and_the_control_devices_are_bound():
    assert gpu_devices([2]) == ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                "/dev/nvidia-modeset"]  # fmt: skip


def test_hidden_paths_inside_another_or_inside_tmp_need_no_mount_of_their_own():
    assert hidden_mounts(("/var/h/jobs", "/var/h", "/tmp/x", "/data/", "/var/h/log-spool", "")) == ["/data", "/var/h"]


@pytest.mark.parametrize(
    "euid, uid_range, sandbox_on, bwrap_found, expected",
    [
        (0, (200000, 299999), True, True, "sandbox"),
        (0, (200000, 299999), False, True, "uid"),
        (0, (200000, 299999), True, False, "uid"),
        (1000, (200000, 299999), True, True, "none"),
        (0, None, True, True, "none"),
    ],
)
def test_the_isolation_a_node_reports(euid, uid_range, sandbox_on, bwrap_found, expected):
    mode, reason = isolation(euid, uid_range, sandbox_on, bwrap_found)

    assert mode == expected
    assert bool(reason) == (expected != "sandbox")


def test_the_data_directory_becomes_searchable_but_not_listable_for_job_uids(public_dir):
    data_dir = public_dir / "var"
    data_dir.mkdir(mode=0o700)

    prepare_node(data_dir, data_dir / "jobs")

    assert [p.stat().st_mode & 0o777 for p in (data_dir, data_dir / "jobs")] == [0o711, 0o711]


def test_a_workdir_root_job_uids_cannot_reach_is_refused_saying_what_to_chmod(public_dir):
    private = public_dir / "private"
    private.mkdir()
    private.chmod(0o700)

    with pytest.raises(OSError, match=f"job uids cannot reach {private}/jobs: chmod o\\+x {private}"):
        prepare_node(public_dir / "var", private / "jobs")


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        (b'{\n    "child-pid": 2009,\n    "mnt-namespace": 4026532175\n}\n', 2009),  # what bwrap 0.8 writes
        (b"", None),  # bwrap failed before it wrote: the write end closed
        (b"not json", None),
        (b'{"other": 1}', None),
    ],
)
def test_the_sandboxs_init_pid_is_read_from_bwraps_info_fd(written, expected):
    read, write = os.pipe()
    os.write(write, written)
    os.close(write)
    try:
        assert init_pid(read) == expected
    finally:
        os.close(read)


def test_no_info_from_bwrap_in_time_is_none():
    read, write = os.pipe()
    try:
        assert init_pid(read, timeout=0.01) is None  # still open, nothing written: no wait for ever
    finally:
        os.close(read)
        os.close(write)


def test_bwraps_exit_code_for_a_signal_is_the_signal_again():
    launch = Launch(200007, box())
    assert [launch.returncode(c) for c in (0, 1, 137, 143, 255)] == [0, 1, -9, -15, 255]
    assert Launch(200007, None).returncode(137) == 137


TOOLS = Tools("/usr/bin/bwrap", "/usr/bin/setpriv", "/usr/bin/prlimit")
DEATH = ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--"]
LIMIT = ["/usr/bin/prlimit", "--as=2097152:2097152", "--"]


def as_uid(uid: int, groups: str = "--clear-groups") -> list[str]:
    """One setpriv takes the uid, then sets the parent-death signal (the uid change clears it)."""
    return ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", groups, "--pdeathsig", "KILL", "--"]


@pytest.mark.parametrize(
    "as_user, limit_mb, found, euid, dies_with_parent, expected",
    [
        ({}, 0, TOOLS, 0, False, [*DEATH, "cmd"]),
        ({}, 2, TOOLS, 1000, False, [*LIMIT, *DEATH, "cmd"]),
        ({"user": 200007, "group": 200007, "extra_groups": []}, 0, TOOLS, 0, False, [*as_uid(200007), "cmd"]),
        (
            {"user": 1001, "group": 1001, "extra_groups": [27, 1001]},
            2,
            TOOLS,
            0,
            False,
            [*LIMIT, *as_uid(1001, "--groups=27,1001"), "cmd"],
        ),
        # a sandbox's argv sets the signal itself (bwrap_argv's setpriv): only the limit goes before it
        ({}, 0, TOOLS, 0, True, ["cmd"]),
        ({}, 2, TOOLS, 0, True, [*LIMIT, "cmd"]),
        # a missing program, or a uid an agent that is not root may not take: forked as before
        ({}, 0, Tools("/usr/bin/bwrap", None, "/usr/bin/prlimit"), 0, False, None),
        ({}, 512, Tools("/usr/bin/bwrap", "/usr/bin/setpriv", None), 0, False, None),
        ({"user": 1001, "group": 1001, "extra_groups": []}, 0, TOOLS, 1000, False, None),
    ],
)
def test_the_job_leaders_argv_does_what_a_preexec_function_did(
    as_user, limit_mb, found, euid, dies_with_parent, expected
):
    assert leader_argv(["cmd"], as_user, limit_mb, found, euid=euid, dies_with_parent=dies_with_parent) == expected


def started_by_a_thread_that_ends(argv: list[str], cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start argv from a thread that ends once the command printed its first line (a parent
    that dies before the death signal is set is never seen: the thread outlives that)."""
    started = []

    def start() -> None:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True)
        started.append((proc, proc.stdout.readline().strip()))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    return started[0]


def test_the_job_leader_dies_with_the_thread_that_started_it():
    found = tools()
    if found.setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    proc, first = started_by_a_thread_that_ends(leader_argv(["sh", "-c", "echo up; exec sleep 30"], {}, 0, found))
    assert first == "up"
    assert proc.wait(timeout=10) == -9


@as_root
def test_the_job_leader_keeps_its_parent_death_signal_and_memory_limit_after_the_uid_change(public_dir):
    as_user = {"user": 200011, "group": 200011, "extra_groups": []}
    argv = leader_argv([SH, "-c", 'echo "$(id -u) $(ulimit -v)"; exec sleep 30'], as_user, 1024, tools())
    proc, first = started_by_a_thread_that_ends(argv, cwd=public_dir)
    assert first == "200011 1048576"  # the uid, and RLIMIT_AS in KiB
    assert proc.wait(timeout=10) == -9


@as_root
def test_every_process_of_a_sandbox_dies_with_the_thread_that_started_it(public_dir):
    """What lets a sandboxed job run without a reaper (agent/runner.py): a child in a session
    of its own and one that ignores SIGTERM and SIGHUP end with the sandbox, whose PID
    namespace ends when bwrap dies with its parent thread."""
    uid = 200013
    workdir = public_dir / "job"
    workdir.mkdir(mode=0o700)
    os.chown(workdir, uid, uid)
    found = tools()
    sandbox = Sandbox(uid=uid, workdir=str(workdir), bwrap=found.bwrap, setpriv=found.setpriv)
    script = "setsid sleep 301 & (trap '' TERM HUP; exec sleep 302) & sleep 0.2; echo up; exec sleep 303"
    argv = leader_argv(bwrap_argv(sandbox, [SH, "-c", script]), {}, 0, found, dies_with_parent=True)
    proc, first = started_by_a_thread_that_ends(argv)
    assert first == "up"
    assert proc.wait(timeout=10) == -9
    deadline = time.monotonic() + 10  # a SIGKILLed process may wait to be scheduled on a loaded machine
    while any(alive(pid) for pid in processes_of(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in processes_of(uid) if alive(pid)] == []


# --- real jobs, real uids, real bubblewrap ------------------------------------------------

SH = "/bin/sh"


@pytest.fixture
def sandboxed(settings):
    settings.HANGAR_SANDBOX = True
    settings.HANGAR_JOB_UID_RANGE = (200000, 299999)
    return settings


@pytest.fixture
def public_dir():
    """A directory job uids can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="hangar-sandbox-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def place(job: Job):
    node = make_node("node-a", gpus=2) if not GPU.objects.exists() else None
    if node is not None:
        GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    (attempt,) = scheduler.schedule_pass()
    assert attempt.job_id == job.pk
    return attempt


def lines_of(attempt) -> list[str]:
    return list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))


def run(job: Job):
    attempt = place(job)
    execution.run_attempt(attempt.pk)
    attempt.refresh_from_db()
    return attempt, lines_of(attempt)


def uid_printed(lines: list[str]) -> int:
    """The uid a job ran as, from its own `id -u`: 200000 + its id, or the next free one when
    another process on this machine holds that one (a job of a sandboxed live stack another
    test runs, whose ids start at 1; agent/sandbox.job_uid)."""
    uid = int(next(line for line in lines if line.strip().isdigit()))
    assert 200000 <= uid <= 299999
    return uid


def shell(script: str) -> list[str]:
    return [SH, "-c", textwrap.dedent(script)]


@as_root
def test_a_job_runs_as_its_own_uid_with_a_private_directory(transactional_db, project, owner, sandboxed):
    job = make_job(project, owner, command=shell('id -u; touch "$HANGAR_CHECKPOINT_DIR/step-1" && echo wrote'))

    attempt, lines = run(job)

    assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
    uid = uid_printed(lines)
    assert "wrote" in lines
    for path in (job.checkpoint_dir().parent, job.checkpoint_dir()):
        info = path.stat()
        assert (info.st_uid, info.st_mode & 0o777) == (uid, 0o700)
    assert (job.checkpoint_dir() / "step-1").stat().st_uid == uid


@as_root
def test_jobs_of_two_projects_see_neither_each_other_nor_hangars_files(
    transactional_db, project, other_project, owner, outsider, sandboxed
):
    victim = make_job(
        project,
        owner,
        command=shell("echo mine > private.txt; echo started; sleep 30"),
        secret_env={"API_TOKEN": "victim-secret-value"},
    )
    attempt = place(victim)
    thread = threading.Thread(target=execution.run_attempt, args=(attempt.pk,), daemon=True)
    thread.start()
    victim_pid = wait_for_process_of(200000 + victim.pk)
    data_dir = sandboxed.DATA_DIR
    spy = make_job(
        other_project,
        outsider,
        command=shell(f"""
            cat /proc/{victim_pid}/environ 2>/dev/null | tr '\\0' '\\n' | grep -c victim-secret-value || echo no-environ
            cat {victim.checkpoint_dir().parent}/private.txt 2>/dev/null || echo no-file
            echo "data dir: $(ls -A {data_dir} | tr '\n' ' ')"
            echo "jobs: $(ls -A {sandboxed.HANGAR_JOB_WORKDIR} | tr '\n' ' ')"
            for f in secret_key hangar.sqlite3 test-hangar.sqlite3 mlflow.db; do
                test -e {data_dir}/$f && echo "sees $f"
            done
            echo "processes $(ls /proc | grep -c '^[0-9]')"
            ps -eo uid= 2>/dev/null | sort -u | tr '\\n' ' '; echo
        """),
    )
    try:
        attempt_b, lines = run(spy)
    finally:
        victim.cancel(owner, "test over")
        thread.join(timeout=30)

    assert attempt_b.state == AttemptState.SUCCEEDED, (attempt_b.reason, lines)
    assert "no-environ" in lines and "no-file" in lines, lines
    assert "data dir: jobs " in lines and f"jobs: {spy.pk} " in lines, lines  # its own directory, nothing else
    assert not [line for line in lines if line.startswith("sees ")], lines
    processes = int(next(line for line in lines if line.startswith("processes ")).split()[1])
    assert processes <= 6, lines  # bwrap's init, the shell, ls, grep: none of the victim's nor the node's
    victim_uid = str(200000 + victim.pk)
    assert victim_uid not in " ".join(line for line in lines if not line.startswith("[hangar]")), lines


def wait_for_process_of(uid: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if entry.stat().st_uid == uid and b"sleep" in Path(entry.path, "cmdline").read_bytes():
                        return int(entry.name)
                except OSError:
                    continue
        time.sleep(0.05)
    raise AssertionError(f"no process of uid {uid} started")


@as_root
def test_volumes_are_bound_as_declared_and_unlisted_ones_are_invisible(
    transactional_db, project, owner, sandboxed, public_dir
):
    for name in ("ro", "rw", "unlisted"):  # (Hangar's umask is 077: say the modes)
        (public_dir / name).mkdir(mode=0o755)
        (public_dir / name).chmod(0o755)
        (public_dir / name / "data.txt").write_text(f"{name}-data\n")
        (public_dir / name / "data.txt").chmod(0o644)
    (public_dir / "rw").chmod(0o777)  # rw volumes must be writable by job uids (README, Security model)
    sandboxed.HANGAR_VOLUME_ROOTS = [str(public_dir)]
    for name in ("ro", "rw", "unlisted"):
        Volume.objects.create(project=project, name=name, path=str(public_dir / name))
    volumes = [
        {"name": "ro", "path": str(public_dir / "ro"), "mode": "ro"},
        {"name": "rw", "path": str(public_dir / "rw"), "mode": "rw"},
    ]
    job = make_job(
        project,
        owner,
        volumes=volumes,
        command=shell(f"""
            cat "$HANGAR_VOLUME_RO/data.txt"
            echo x > "$HANGAR_VOLUME_RO/new.txt" 2>/dev/null && echo ro-writable || echo ro-refused
            echo written > "$HANGAR_VOLUME_RW/out.txt" && echo rw-ok
            cat {public_dir}/unlisted/data.txt 2>/dev/null || echo unlisted-invisible
        """),
    )

    attempt, lines = run(job)

    assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
    assert "ro-data" in lines and "ro-refused" in lines and "rw-ok" in lines and "unlisted-invisible" in lines, lines
    assert (public_dir / "rw" / "out.txt").read_text() == "written\n"
    assert not (public_dir / "ro" / "new.txt").exists()


@pytest.fixture
def listening():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


@as_root
@pytest.mark.parametrize("network, reached", [("none", False), ("host", True)])
def test_a_project_without_network_reaches_no_port_of_the_host(
    transactional_db, project, owner, sandboxed, listening, network, reached
):
    project.network = network
    project.save(update_fields=["network"])
    bash = shutil.which("bash")
    job = make_job(project, owner, command=[bash, "-c", f"echo hi > /dev/tcp/127.0.0.1/{listening} && echo connected"])

    attempt, lines = run(job)

    assert ("connected" in lines) == reached, lines
    assert attempt.state == (AttemptState.SUCCEEDED if reached else AttemptState.FAILED), lines


@as_root
def test_a_container_jobs_path_never_chooses_the_docker_program(
    transactional_db, project, owner, sandboxed, public_dir
):
    canary = public_dir / "canary"
    evil = public_dir / "bin"
    evil.mkdir()
    evil.chmod(0o755)
    (evil / "docker").write_text(f"#!/bin/sh\ntouch {canary}\n")
    (evil / "docker").chmod(0o755)
    image = Environment.objects.create(
        name="pt", kind=EnvironmentKind.CONTAINER, image="pytorch:latest", everywhere=True
    )
    # Written to the row directly: the submit refuses PATH for a container job (tested below).
    job = make_job(project, owner, environment=image, env={"PATH": str(evil)}, command=["python", "-V"])

    attempt, lines = run(job)

    assert not canary.exists(), lines
    assert attempt.state == AttemptState.FAILED  # no docker engine here: the real client ran, and failed


@as_root
def test_cancel_reaches_the_sandboxed_job_with_its_grace_period(transactional_db, project, owner, sandboxed, settings):
    settings.HANGAR_KILL_GRACE_SECONDS = 5
    script = "trap 'echo got-term; sleep 0.5; echo saved; exit 3' TERM; echo started; sleep 60 & wait; sleep 60"
    job = make_job(project, owner, command=shell(script))
    attempt = place(job)
    thread = threading.Thread(target=execution.run_attempt, args=(attempt.pk,), daemon=True)
    thread.start()
    wait_for_process_of(200000 + job.pk)
    job.cancel(owner, "test")
    thread.join(timeout=30)
    attempt.refresh_from_db()

    lines = lines_of(attempt)
    assert attempt.state == AttemptState.CANCELLED and "got-term" in lines and "saved" in lines, lines
    assert not any(e.name.isdigit() and owned_by(e, 200000 + job.pk) for e in os.scandir("/proc"))


def owned_by(entry, uid: int) -> bool:
    try:
        return entry.stat().st_uid == uid and Path(entry.path, "cmdline").read_bytes() != b""
    except OSError:
        return False


def test_a_node_reports_its_isolation_and_its_pages_show_when_it_is_less_than_a_sandbox(db, owner):
    from django.test import Client
    from django.urls import reverse

    from agent.node import Agent
    from fleet.gpus import detect_provider

    agent = Agent("node-z", detect_provider("node-z", True, "H100", 1), 1.0)
    agent.isolation = isolation(1000, (200000, 299999), True, True)  # an agent that is not root

    node = agent.register()

    assert node.isolation == "none" and "does not run as root" in node.isolation_reason
    browser = Client()
    browser.force_login(owner)
    for url in (reverse("fleet"), reverse("fleet-node", args=["node-z"])):
        assert "isolation: none" in browser.get(url).content.decode()
    assert api_client(owner).get("/api/v1/nodes/node-z/").json()["isolation"] == "none"


@as_root
def test_with_the_sandbox_off_a_job_keeps_its_own_uid_and_reads_none_of_hangars_files(
    transactional_db, project, owner, sandboxed
):
    sandboxed.HANGAR_SANDBOX = False
    data_dir = sandboxed.DATA_DIR
    script = f"""
        id -u
        ls {data_dir} >/dev/null 2>&1 && echo listed || echo cannot-list
        cat {data_dir}/secret_key >/dev/null 2>&1 && echo read-key || echo cannot-read-key
    """
    job = make_job(project, owner, command=shell(script))

    attempt, lines = run(job)

    assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
    assert str(200000 + job.pk) in lines and "cannot-list" in lines and "cannot-read-key" in lines, lines


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
RANKS = """
import os, socket, time
port = int(os.environ["MASTER_PORT"]) + 1
if os.environ["RANK"] == "0":
    server = socket.create_server(("0.0.0.0", port))
    server.settimeout(30)
    peer, _ = server.accept()
    peer.sendall(b"hello from rank 0")
    peer.close()
    print("rank 0 served", flush=True)
else:
    for _ in range(300):
        try:
            with socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=1) as s:
                print("rank 1 got", s.recv(64).decode(), flush=True)
                break
        except OSError:
            time.sleep(0.1)
"""


@as_root
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a python3 that job uids can run")
def test_the_ranks_of_a_two_node_job_reach_each_other_from_their_sandboxes(
    transactional_db, project, owner, sandboxed, settings
):
    job, attempt, lines = run_two_ranks(project, owner, settings, command=[SYSTEM_PYTHON, "-c", RANKS])

    assert job.state == "succeeded", (attempt.reason, lines)
    assert "rank 0 served" in lines and "rank 1 got hello from rank 0" in lines, lines
    assert job.checkpoint_dir().parent.stat().st_uid == 200000 + job.pk  # both ranks: the job's one uid


GLOO_ALL_REDUCE = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank={dist.get_rank()} uid={os.getuid()} sum={value.item():g}", flush=True)
dist.barrier()  # TRAPS.md: gloo can abort at exit without it
dist.destroy_process_group()
"""


@as_root
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a python3 that job uids can run")
def test_a_two_node_torch_gloo_job_all_reduces_from_its_sandboxes(
    transactional_db, project, owner, sandboxed, settings
):
    """A real torch.distributed job under the sandbox. The suite's interpreter may be out of job
    uids' reach (pyenv under /root), so the system's python3 runs it with the suite's torch,
    mounted as a read-only volume (the checkout may be under /tmp, private in a sandbox)."""
    torch = pytest.importorskip("torch")
    packages = os.path.dirname(os.path.dirname(torch.__file__))
    job, attempt, lines = run_two_ranks(
        project, owner, settings, command=[SYSTEM_PYTHON, "-c", GLOO_ALL_REDUCE],
        env={"PYTHONPATH": packages, "GLOO_SOCKET_IFNAME": "lo"},
        volumes=[{"name": "torch", "path": packages, "mode": "ro", "version": ""}],
    )  # fmt: skip
    assert job.state == "succeeded", (attempt.reason, lines)
    uid = 200000 + job.pk
    assert f"rank=0 uid={uid} sum=3" in lines and f"rank=1 uid={uid} sum=3" in lines, lines


def run_two_ranks(project, owner, settings, **fields):
    """A 2-node job of one GPU a node, both nodes on this machine, each rank run here as its agent
    would: (the job, its attempt, its log lines) once both ranks ended."""
    from agent import running

    running.CURRENT = None  # preflight asks this process's agent, if any: none here
    for name in ("node-a", "node-b"):
        node = make_node(name, gpus=1, hostname="127.0.0.1")  # two agents on one machine
        GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    job = make_job(project, owner, nodes=2, gpus_per_node=1, **fields)
    (attempt,) = scheduler.schedule_pass()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        settings.HANGAR_MASTER_PORT_BASE = probe.getsockname()[1] - attempt.pk % 1000
    threads = [threading.Thread(target=execution.run_attempt, args=(attempt.pk, r)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    job.refresh_from_db()
    attempt.refresh_from_db()
    return job, attempt, lines_of(attempt)
