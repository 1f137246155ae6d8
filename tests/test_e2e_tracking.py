"""End to end: a real job logs metrics with `mlflow` from inside its process, with no set-up,
through Hangar's tracking proxy (never the store itself); Hangar made the run, tagged it, closed
it with the job's cost, and the job page's chart data has the points. A job's credential writes
and reads its own run only, and stops working when its attempt ends: the attacks below use the
real MLflow client in real job processes, on the embedded store and on a real MLflow tracking
server in services mode."""

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.factories import services_database
from tests.livestack import LiveStack, die_with_parent, free_port
from tests.services import wait_for_port

pytestmark = pytest.mark.e2e

DONE = ("succeeded", "failed", "cancelled")
STARTED = "tracking job started"  # printed first: a job that never printed it was never started

TRAIN = textwrap.dedent(
    f"""
    import os
    print("{STARTED}", flush=True)
    print("uri", os.environ["MLFLOW_TRACKING_URI"], flush=True)
    import mlflow
    mlflow.log_param("lr", "0.1")
    mlflow.set_tag("phase", "train")
    for step in range(5):
        mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
    mlflow.log_metric("accuracy", 0.9, step=4)
    print("logged", flush=True)
    """
)

# The attacker's process: its own credential, another job's run id (argv), the real client.
ATTACK = textwrap.dedent(
    f"""
    import faulthandler, os, sys
    print("{STARTED}", flush=True)
    faulthandler.dump_traceback_later(90, exit=True)  # a call that hangs says where, in the job's log
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="10")  # refusals are not retried
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    victim, experiment, own = sys.argv[1], os.environ["MLFLOW_EXPERIMENT_ID"], os.environ["MLFLOW_RUN_ID"]
    c = MlflowClient()
    attacks = {{
        "log_metric": lambda: c.log_metric(victim, "loss", 999.0, step=99),
        "log_batch": lambda: c.log_batch(victim, metrics=[Metric("loss", 999.0, 0, 98)], params=[Param("x", "1")]),
        "log_param": lambda: c.log_param(victim, "lr", "999"),
        "set_tag": lambda: c.set_tag(victim, "owned", "yes"),
        "delete_tag": lambda: c.delete_tag(victim, "phase"),
        "set_status": lambda: c.set_terminated(victim, "FAILED"),
        "rename": lambda: c.update_run(victim, name="owned"),
        "get_run": lambda: c.get_run(victim),
        "history": lambda: c.get_metric_history(victim, "loss"),
        "search": lambda: c.search_runs([experiment]),
        "delete_run": lambda: c.delete_run(victim),
        "create_run": lambda: c.create_run(experiment),
        "forge_cost": lambda: c.set_tag(own, "hangar.cost", "0"),
    }}
    if len(sys.argv) > 2:  # the store's own address, learnt somehow: past Hangar altogether
        attacks["direct"] = lambda: MlflowClient(sys.argv[2]).log_metric(victim, "loss", 999.0, step=97)
    for name, attack in attacks.items():
        try:
            attack()
            print("ALLOWED", name, flush=True)
        except MlflowException as exc:
            print("refused", name, exc.error_code, flush=True)
    c.log_metric(own, "own", 1.0)
    print("own run written", flush=True)
    """
)

# A job that shows its credential (the test then plays a process left over from it) and fails.
SHOW_CREDENTIAL = textwrap.dedent(
    f"""
    import os, sys
    print("{STARTED}", flush=True)
    import mlflow
    mlflow.log_metric("loss", 0.5, step=0)
    print("credential", os.environ["MLFLOW_TRACKING_TOKEN"], flush=True)
    sys.exit(3)
    """
)

LATE_CLIENT = textwrap.dedent(
    """
    import sys
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    c, run = MlflowClient(), sys.argv[1]
    for name, call in [
        ("log_metric", lambda: c.log_metric(run, "late", 1.0)),
        ("history", lambda: c.get_metric_history(run, "loss")),
        ("set_terminated", lambda: c.set_terminated(run, "FINISHED")),  # with its get_run, when URLs are printed
    ]:
        try:
            call()
            print(name, "ok", flush=True)
        except MlflowException as exc:
            print(name, exc.error_code, flush=True)
            print(exc.message, file=sys.stderr, flush=True)
    """
)

REFUSED = {
    **dict.fromkeys(
        ["log_metric", "log_batch", "log_param", "set_tag", "delete_tag", "set_status", "rename", "get_run", "history"],
        "PERMISSION_DENIED",
    ),
    **dict.fromkeys(["search", "delete_run", "create_run"], "ENDPOINT_NOT_FOUND"),
    "forge_cost": "PERMISSION_DENIED",
}


def lines_of(stack: LiveStack, job_id: int) -> list[str]:
    return [line["text"] for line in stack.api("GET", f"/api/v1/jobs/{job_id}/logs/?limit=5000").json()["lines"]]


def run_job(stack: LiveStack, code: str, *args: str, expect: str = "succeeded", **fields) -> tuple[dict, list[str]]:
    job = stack.submit([sys.executable, "-c", code, *args], environment="cuda", **fields)
    try:
        done = stack.wait_for(job["id"], DONE, timeout=120)
    except AssertionError as exc:
        raise AssertionError("\n".join(["its log:", *lines_of(stack, job["id"])])) from exc
    lines = lines_of(stack, job["id"])
    assert STARTED in lines, f"job {job['id']} never started its command (not the proxy's doing):\n" + "\n".join(lines)
    assert done["state"] == expect, "\n".join(lines)
    return done, lines


def wait_for_tag(client, run_id: str, tag: str, timeout: float = 30):
    """The run once the notifier wrote `tag` (after the attempt's end)."""
    deadline = time.monotonic() + timeout
    run = client.get_run(run_id)
    while tag not in run.data.tags and time.monotonic() < deadline:
        time.sleep(0.2)
        run = client.get_run(run_id)
    return run


def check_the_run_and_its_chart(stack: LiveStack, store, done: dict, lines: list[str]) -> None:
    assert f"uri {stack.url}/api/mlflow" in lines  # the proxy, never the store
    assert done["mlflow_run_id"] and not done["tracking_error"]
    run = wait_for_tag(store, done["mlflow_run_id"], "hangar.cost")
    tags = run.data.tags
    assert tags["hangar.job_id"] == str(done["id"]) and tags["hangar.project"] == "default"
    assert tags["hangar.code_version"] == "deadbeef" and tags["hangar.nodes"] == "node-a"
    assert tags["hangar.user"] == "admin" and tags["phase"] == "train" and run.data.params == {"lr": "0.1"}
    assert run.info.status == "FINISHED"
    assert store.get_experiment(run.info.experiment_id).name == "hangar/default"

    chart = stack.api("GET", f"/api/v1/jobs/{done['id']}/metrics/").json()
    assert chart["available"] and chart["final"]
    assert [p[:2] for p in chart["series"]["loss"]] == [[i, 1.0 / (i + 1)] for i in range(5)]
    loss = next(trace for trace in chart["figure"]["data"] if trace["name"] == "loss")
    assert loss["x"] == [0, 1, 2, 3, 4] and loss["y"] == [1.0 / (i + 1) for i in range(5)]


def check_the_attack(stack: LiveStack, store, victim: dict, *direct: str) -> None:
    before = store.get_run(victim["mlflow_run_id"])
    attacker, lines = run_job(stack, ATTACK, victim["mlflow_run_id"], *direct, name="attacker")
    outcome = {line.split()[1]: line.split()[2] for line in lines if line.startswith(("refused", "ALLOWED"))}
    refused = {**REFUSED, **dict.fromkeys(["direct"] if direct else [], "UNAUTHENTICATED")}
    assert outcome == refused, "\n".join(lines)
    assert "own run written" in lines  # its own run it writes
    after = store.get_run(victim["mlflow_run_id"])
    assert after.data.metrics == before.data.metrics and after.data.params == before.data.params
    assert after.data.tags == before.data.tags and after.info.status == before.info.status == "FINISHED"
    history = store.get_metric_history(victim["mlflow_run_id"], "loss")
    assert sorted(m.value for m in history) == sorted(1.0 / (i + 1) for i in range(5))
    assert store.get_run(attacker["mlflow_run_id"]).data.metrics == {"own": 1.0}


def late_client(stack: LiveStack, credential: str, run_id: str) -> dict[str, str]:
    """A process of an ended attempt, still holding its credential, with the real client."""
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"{stack.url}/api/mlflow",
        "MLFLOW_TRACKING_TOKEN": credential,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    done = subprocess.run([sys.executable, "-c", LATE_CLIENT, run_id], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    print(done.stderr)  # why each call was refused, shown when the test fails
    said = [line.split(maxsplit=1) for line in done.stdout.splitlines()]
    return {words[0]: words[1] for words in said if words[0] in ("log_metric", "history", "set_terminated")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LiveStack(data_dir=str(tmp_path_factory.mktemp("tracking"))) as stack:
        yield stack


@pytest.fixture(scope="module")
def trained(stack) -> tuple[dict, list[str]]:
    return run_job(stack, TRAIN, name="train", code_version="deadbeef")


@pytest.fixture(scope="module")
def store(stack, trained):
    """The store itself, read by the test; opened once a job ran (the stack made its tables by then)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{stack.data_dir}/mlflow.db")


def test_a_job_logs_metrics_params_and_tags_to_its_run_with_no_set_up(stack, store, trained):
    check_the_run_and_its_chart(stack, store, *trained)


def test_a_job_cannot_write_or_read_another_jobs_run(stack, store, trained):
    check_the_attack(stack, store, trained[0])


def test_an_ended_attempts_credential_no_longer_writes_and_its_exit_update_changes_nothing(stack, store):
    done, lines = run_job(stack, SHOW_CREDENTIAL, name="ends", expect="failed")
    credential = next(line.split()[1] for line in lines if line.startswith("credential "))
    run = wait_for_tag(store, done["mlflow_run_id"], "hangar.cost")
    assert run.info.status == "FAILED"  # written by Hangar after the job's own exit update
    assert late_client(stack, credential, done["mlflow_run_id"]) == {
        "log_metric": "PERMISSION_DENIED",
        "history": "PERMISSION_DENIED",
        "set_terminated": "ok",  # what MLflow's client sends at exit: answered, nothing written
    }
    run = store.get_run(done["mlflow_run_id"])
    assert run.info.status == "FAILED" and "late" not in run.data.metrics


def test_a_sandboxed_job_logs_metrics_with_no_set_up(tmp_path):
    # The embedded store lives in the data directory, which the sandbox hides: through the
    # proxy the job never needs it (before, `unable to open database file`).
    env = {"HANGAR_SANDBOX": "on", "HANGAR_JOB_UID_RANGE": "300000-399999"}
    where = "import os, sys\nprint('uid', os.getuid(), 'store seen', os.path.exists(sys.argv[1]), flush=True)\n"
    with LiveStack(data_dir=str(tmp_path), env=env) as stack:
        from mlflow.tracking import MlflowClient

        done, lines = run_job(stack, TRAIN + where, str(tmp_path / "mlflow.db"), name="train", code_version="deadbeef")
        uid, seen = next(line.split()[1::3] for line in lines if line.startswith("uid "))
        assert 300000 <= int(uid) <= 399999 and seen == "False"  # its own uid; the data directory hidden
        check_the_run_and_its_chart(stack, MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), done, lines)


# --- services mode: a real MLflow tracking server --------------------------------------

# mlflow (the server: Flask, pandas, scikit-learn, ~850 MB) is built once per machine in a
# throw-away virtualenv outside the repository, which a later run finds complete.
MLFLOW_SERVER = "mlflow[auth]==3.17.2"
MLFLOW_SERVER_VENV = Path(tempfile.gettempdir()) / "hangar-e2e-mlflow-server-3.17.2-auth"
# As the README asks of a server the nodes' network reaches: only Hangar's processes have its credentials.
SERVER_USER, SERVER_PASSWORD = "hangar", "e2e-" + os.urandom(8).hex()
AUTH_CONFIG = """[mlflow]
default_permission = READ
database_uri = sqlite:///{folder}/auth.db
admin_username = {user}
admin_password = {password}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
"""


def mlflow_server_venv() -> Path:
    with open(f"{MLFLOW_SERVER_VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run on this machine may be building it
        ready = MLFLOW_SERVER_VENV / "ready"
        if not ready.exists():
            subprocess.run(["rm", "-rf", str(MLFLOW_SERVER_VENV)], check=True)
            subprocess.run([sys.executable, "-m", "venv", str(MLFLOW_SERVER_VENV)], check=True)
            pip = [str(MLFLOW_SERVER_VENV / "bin" / "pip"), "install", "-q", MLFLOW_SERVER]
            built = subprocess.run(pip, capture_output=True, text=True, timeout=900)
            assert built.returncode == 0, f"{' '.join(pip)} failed:\n{built.stderr[-3000:]}"
            ready.touch()
    return MLFLOW_SERVER_VENV / "bin" / "mlflow"


@pytest.fixture
def mlflow_server(tmp_path):
    mlflow = mlflow_server_venv()
    port = free_port()
    argv = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    argv += ["--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--default-artifact-root", str(tmp_path / "art")]
    argv += ["--app-name", "basic-auth"]
    config = tmp_path / "auth.ini"
    config.write_text(AUTH_CONFIG.format(folder=tmp_path, user=SERVER_USER, password=SERVER_PASSWORD))
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no background job runners
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": os.urandom(16).hex(),  # the auth app's CSRF key
    }
    with open(tmp_path / "mlflow-server.log", "ab") as out:
        server = subprocess.Popen(
            argv,
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    try:
        wait_for_server(server, port, tmp_path / "mlflow-server.log")
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # its workers are in its session; its store is thrown away
        server.wait(timeout=30)


def wait_for_server(server: subprocess.Popen, port: int, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        try:
            wait_for_port(port, timeout=1)
            return
        except RuntimeError:
            continue
    raise RuntimeError(f"the MLflow server did not listen on {port}:\n{log.read_text(errors='replace')[-3000:]}")


def test_services_mode_with_a_real_tracking_server(mlflow_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    credentials = {"MLFLOW_TRACKING_USERNAME": SERVER_USER, "MLFLOW_TRACKING_PASSWORD": SERVER_PASSWORD}
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)  # the test reads the store as Hangar does
    with services_database() as services:
        env = {**services, "MLFLOW_TRACKING_URI": mlflow_server, **credentials}
        with LiveStack(data_dir=str(tmp_path / "stack"), env=env) as stack:
            store = MlflowClient(mlflow_server)
            done, lines = run_job(stack, TRAIN, name="train", code_version="deadbeef")
            assert mlflow_server not in "\n".join(lines)  # the job is never told the server's address
            check_the_run_and_its_chart(stack, store, done, lines)
            # Through the proxy, and straight to the server (whose credentials only Hangar has).
            check_the_attack(stack, store, done, mlflow_server)
