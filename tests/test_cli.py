"""The `hangar` CLI against a live Hangar (web, scheduler, node agent): it speaks
only HTTP and websockets, as an agent on another machine would."""

import json
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone

import pytest

from hangar import cli
from tests.livestack import BASE_DIR, LiveStack

pytestmark = pytest.mark.e2e
PY = sys.executable


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LiveStack(data_dir=str(tmp_path_factory.mktemp("cli-stack"))) as live:
        yield live


@pytest.fixture
def hangar(stack, tmp_path, monkeypatch, capsys):
    """Run the CLI in-process as `hangar ARGS...`; returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("HANGAR_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.delenv("HANGAR_TOKEN", raising=False)
    monkeypatch.delenv("HANGAR_URL", raising=False)
    assert cli.main(["login", "--url", stack.url, "--token", stack.token, "--project", "default"]) == 0
    capsys.readouterr()

    def run(*args: str) -> tuple[int, str, str]:
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def script(body: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(body)]


def test_submit_follow_streams_every_line_and_exits_with_the_outcome(hangar):
    code, out, err = hangar(
        "submit",
        "--name",
        "counter",
        "--",
        *script(
            """
            import sys
            for i in range(20):
                print(f"count {i}", flush=True)
            print("bad thing", file=sys.stderr, flush=True)
            sys.exit(3)
            """
        ),
    )
    assert code == 0, err
    job_id = int(out.split()[1])

    code, out, err = hangar("logs", str(job_id), "--follow")

    texts = [line.split(None, 4)[-1] for line in out.splitlines()]
    assert [t for t in texts if t.startswith("count")] == [f"count {i}" for i in range(20)]
    assert "bad thing" in texts
    assert code == cli.EXIT_JOB_FAILED and f"job {job_id} failed, exit 3" in err

    code, out, _ = hangar("wait", str(job_id))
    assert code == cli.EXIT_JOB_FAILED and "failed, exit 3" in out


def test_json_output_parses_and_wait_exits_zero_on_success(hangar):
    code, out, _ = hangar(
        "--json", "submit", "--idempotency-key", "cli-1", "-e", "GREETING=hi", "--", PY, "-c", "print(1)"
    )
    job = json.loads(out)
    assert code == 0 and job["env"] == {"GREETING": "hi"}
    again = json.loads(
        hangar("--json", "submit", "--idempotency-key", "cli-1", "-e", "GREETING=hi", "--", PY, "-c", "print(1)")[1]
    )
    assert again["id"] == job["id"]

    code, out, _ = hangar("wait", str(job["id"]), "--json")
    assert code == 0 and json.loads(out)["state"] == "succeeded"

    status = json.loads(hangar("status", str(job["id"]), "--json")[1])
    assert status["attempts"][0]["exit_code"] == 0
    listed = json.loads(hangar("list", "--json", "--mine")[1])
    assert job["id"] in [j["id"] for j in listed]
    nodes = json.loads(hangar("nodes", "--json")[1])
    assert [n["name"] for n in nodes] == ["node-a"]
    lines = [json.loads(line) for line in hangar("logs", str(job["id"]), "--json")[1].splitlines()]
    assert [line["text"] for line in lines if line["stream"] == "stdout"] == ["1"]

    code, out, _ = hangar("queue")
    assert code == 0 and out.startswith("waiting") and "running" in out
    assert set(json.loads(hangar("queue", "--json")[1])) == {"waiting", "running"}

    code, out, _ = hangar("cost", "--by", "gpu_type", "--json")
    cost = json.loads(out)
    assert code == 0 and cost["by"] == "gpu_type"
    assert "H100" in [row["gpu_type"] for row in cost["rows"]]  # finished attempts count under their GPU type


def test_logs_filters_and_human_tables(hangar):
    code, out, err = hangar(
        "submit",
        "--wait",
        "--",
        *script("import sys\nprint('alpha 1')\nprint('beta 2')\nprint('oops', file=sys.stderr)"),
    )
    assert code == 0, err
    job_id = out.split()[1]
    assert "STATE" in out and "node-a" in out  # the attempts table

    grep = hangar("logs", job_id, "--grep", "^beta")[1].splitlines()
    warnings = hangar("logs", job_id, "--severity", "warning")[1].splitlines()
    assert len(grep) == 1 and grep[0].endswith("beta 2")
    assert [line.split(None, 4)[-1] for line in warnings] == ["oops"]
    assert "NAME" in hangar("nodes")[1] and "node-a" in hangar("nodes")[1]


def test_job_file_and_cancel(hangar, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"name: sleeper\ncommand: [{PY}, -c, 'import time; time.sleep(60)']\nenv:\n  A: '1'\n")
    code, out, _ = hangar("--json", "submit", "-f", str(job_file))
    job = json.loads(out)
    assert code == 0 and job["name"] == "sleeper" and job["env"] == {"A": "1"}

    code, out, _ = hangar("cancel", str(job["id"]), "--reason", "enough")
    assert code == 0
    code, _, _ = hangar("wait", str(job["id"]), "--timeout", "30")
    assert code == cli.EXIT_CANCELLED


def test_errors_are_clear_and_exit_codes_mean_something(hangar):
    code, out, err = hangar("--json", "submit", "--gpus", "64", "--", "true")
    assert code == cli.EXIT_API
    assert json.loads(out)["errors"][0]["field"] == "gpus_per_node" and "ask for at most 4" in err

    code, _, err = hangar("status", "999999")
    assert code == cli.EXIT_API and "not found" in err

    code, _, err = hangar("submit")
    assert code == cli.EXIT_USAGE and "no command" in err

    code, _, err = hangar("status", "1", "--url", "http://127.0.0.1:9")
    assert code == cli.EXIT_UNREACHABLE and "cannot reach" in err

    code, _, err = hangar("status", "1", "--token", "hgr_wrong")
    assert code == cli.EXIT_API and "hangar login" in err

    # A refused log stream (accepted, then closed with 4404) ends at once with what to check.
    code, _, err = hangar("logs", "999999", "--follow")
    assert code == cli.EXIT_API and "(4404)" in err and "job id" in err

    code, _, err = hangar("cordon", "no-such-node", "--reason", "test")
    assert code == cli.EXIT_API and err.startswith("hangar: ")
    code, _, err = hangar("cordon", "node-a")
    assert code == cli.EXIT_USAGE and "--reason" in err


def test_the_console_script_entry_point_runs(stack, tmp_path):
    env = {"HANGAR_URL": stack.url, "HANGAR_TOKEN": stack.token, "HANGAR_CONFIG": str(tmp_path / "c.json"), "PATH": ""}
    done = subprocess.run(
        [PY, "-m", "hangar.cli", "--json", "nodes"], capture_output=True, text=True, env=env, timeout=60, cwd=BASE_DIR
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["name"] == "node-a"


def test_the_cli_never_loads_the_database_layer():
    server = ("django", "jobs", "fleet", "agent", "portal")
    probe = f"import sys, hangar.cli; print(sorted(m for m in sys.modules if m.startswith({server!r})))"
    done = subprocess.run([PY, "-c", probe], capture_output=True, text=True, cwd=BASE_DIR, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_priority_classes_come_from_the_server(hangar):
    code, out, _ = hangar("--json", "priorities")
    assert code == cli.EXIT_OK
    names = [c["name"] for c in json.loads(out)]
    assert names == ["urgent", "high", "normal", "low", "scavenger"]  # the server's default classes, highest first

    code, _, err = hangar("submit", "--priority", "nonesuch", "--", "true")
    assert code == cli.EXIT_API and "nonesuch is not a priority class; use one of urgent, high" in err


def test_the_python_client_submits_and_waits(stack, monkeypatch):
    from hangar.client import Client, HangarError

    monkeypatch.setenv("HANGAR_URL", stack.url)
    monkeypatch.setenv("HANGAR_TOKEN", stack.token)
    client = Client.from_config()
    job = client.wait(client.submit({"project": "default", "command": ["true"]}, idempotency_key="py-1")["id"], 60)
    assert job["state"] == "succeeded"
    assert client.submit({"project": "default", "command": ["true"]}, idempotency_key="py-1")["id"] == job["id"]
    with pytest.raises(HangarError) as refused:
        client.submit({"project": "default", "command": "true"})
    assert refused.value.code == cli.EXIT_API and refused.value.body["errors"][0]["field"] == "command"


def test_follow_streams_wide_lines_in_bounded_messages(hangar):
    """3,000 lines of 1,500 characters: more than 1 MiB a batch (issue: 0 lines, reconnecting for ever)."""
    code, out, err = hangar(
        "submit", "--", *script("for i in range(3000):\n    print(f'{i:05d} ' + 'x' * 1500, flush=True)")
    )
    assert code == 0, err
    job_id = out.split()[1]

    code, out, err = hangar("logs", job_id, "--follow")

    numbers = [line.split(None, 4)[-1][:5] for line in out.splitlines() if line.split(None, 4)[-1][:1].isdigit()]
    assert code == cli.EXIT_OK, err
    assert numbers == [f"{i:05d}" for i in range(3000)]


def test_the_client_filters_mean_what_the_servers_do_and_resume_from_a_cursor(hangar):
    code, out, err = hangar(
        "submit", "--wait", "--", *script("for i in range(6):\n    print(f'NCCL WARN step {i}', flush=True)")
    )
    assert code == 0, err
    job_id = out.split()[1]
    lines = [json.loads(line) for line in hangar("logs", job_id, "--json")[1].splitlines()]
    steps = [line for line in lines if line["text"].startswith("NCCL")]

    assert len(hangar("logs", job_id, "--grep", "nccl warn")[1].splitlines()) == 6  # case-insensitive, as q=
    first = datetime.fromisoformat(steps[0]["ts"].replace("Z", "+00:00"))
    same_instant = first.astimezone(timezone(timedelta(hours=1))).isoformat()  # ...T10:30:00+01:00
    a_second_later = (first + timedelta(seconds=1)).astimezone(timezone(timedelta(hours=1))).isoformat()
    assert len(hangar("logs", job_id, "--since", same_instant, "--grep", "step")[1].splitlines()) == 6
    assert hangar("logs", job_id, "--since", a_second_later, "--grep", "step")[1] == ""

    code, out, _ = hangar("logs", job_id, "--json", "--after", steps[2]["cursor"])
    resumed = [json.loads(line)["text"] for line in out.splitlines()]
    assert code == 0 and resumed[:3] == ["NCCL WARN step 3", "NCCL WARN step 4", "NCCL WARN step 5"]
    assert hangar("logs", job_id, "--after", "3")[0] == cli.EXIT_USAGE


def test_bad_job_files_and_cancelling_an_ended_job_say_so(hangar, tmp_path):
    code, out, err = hangar("submit", "-f", str(tmp_path / "nonexistent.yaml"))
    assert code == cli.EXIT_USAGE and err.count("\n") == 1 and "cannot read job file" in err and "Traceback" not in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("command: [python, train.py\n")
    code, _, err = hangar("submit", "-f", str(broken))
    assert code == cli.EXIT_USAGE and "is not valid YAML" in err and err.count("\n") == 1

    code, out, _ = hangar("submit", "--wait", "--", "true")
    job_id = out.split()[1]
    code, _, err = hangar("cancel", job_id)
    assert code == cli.EXIT_API and f"job {job_id} already ended (succeeded, exit 0)" in err


def test_status_shows_every_ranks_node_and_gpus():
    attempt = {
        "number": 1, "state": "running", "node": "gpu-a", "gpu_indices": [0, 1], "started_at": None,
        "finished_at": None, "exit_code": None, "failure_class": "",
        "placement": [{"rank": 0, "node": "gpu-a", "gpus": [0, 1]}, {"rank": 1, "node": "gpu-b", "gpus": [2, 3]}],
    }  # fmt: skip
    job = {
        "id": 7, "name": "ddp", "project": "vision", "submitted_by": "ada", "state": "running", "command": ["torchrun"],
        "gpus_per_node": 2, "nodes": 2, "priority": "normal", "attempts": [attempt],
    }  # fmt: skip
    assert "gpu-a[0,1] gpu-b[2,3]" in cli.describe(job)


def test_a_job_in_the_hangar_venv_environment_runs_this_virtualenvs_python(hangar):
    code, out, err = hangar(
        "submit", "--wait", "--environment", "hangar-venv", "--", "python", "-c", "import sys; print(sys.prefix)"
    )
    assert code == 0, err
    job_id = out.split()[1]
    printed = [line.split(None, 4)[-1] for line in hangar("logs", job_id)[1].splitlines()]
    assert sys.prefix in printed
