"""End to end, as an agent runs it: a real stack, the real `hangar` CLI in its own process.
A script that prints `val_loss: 0.5` lines yields MLflow metrics and the objective in its
result; a crashed one yields a result with a diagnosis and the log tail; `wait --json`
prints one document per job and a timed-out wait exits 124."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.livestack import BASE_DIR, LiveStack

pytestmark = pytest.mark.e2e
PY = sys.executable

TRAIN = textwrap.dedent(
    """
    for step, loss in enumerate([0.9, 0.5, 0.7]):
        print(f"step {step} val_loss: {loss}", flush=True)
    print("accuracy: 0.75", flush=True)
    """
)
CRASH = "print('loading', flush=True)\nraise ValueError('the learning rate is negative')"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LiveStack(data_dir=str(tmp_path_factory.mktemp("results-stack"))) as live:
        yield live


@pytest.fixture
def hangar(stack, tmp_path):
    env = {**os.environ, "HANGAR_URL": stack.url, "HANGAR_TOKEN": stack.token, "HANGAR_CONFIG": str(tmp_path / "c")}

    def run(*args: str, timeout: float = 120) -> tuple[int, str, str]:
        done = subprocess.run(
            [PY, "-m", "hangar.cli", *args], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=timeout
        )
        return done.returncode, done.stdout, done.stderr

    return run


def submit(hangar, tmp_path, name: str, body: str, **fields) -> int:
    spec = {"project": "default", "name": name, "command": [PY, "-c", body], **fields}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    code, out, err = hangar("submit", "-f", str(path), "--json")
    assert code == 0, err
    return json.loads(out)["id"]


def test_metrics_from_the_log_give_the_objective_and_a_crash_gives_its_diagnosis(hangar, tmp_path):
    pattern = r"(?P<name>val_loss|accuracy): (?P<value>[-+0-9.eE]+)"
    objective = {"metric": "val_loss", "mode": "min"}
    train = submit(hangar, tmp_path, "train", TRAIN, metrics_from_log=pattern, objective=objective)
    crash = submit(hangar, tmp_path, "crash", CRASH, objective=objective)

    code, out, err = hangar("wait", str(train), str(crash), "--json")
    docs = [json.loads(line) for line in out.splitlines()]
    assert code == 1, err  # the first non-zero outcome in order: the crash's
    assert [d["id"] for d in docs] == [train, crash]

    done = docs[0]
    assert done["state"] == "succeeded" and done["exit_code"] == 0, done
    assert done["objective"] == {**objective, "value": 0.7, "step": 2, "best": 0.5, "best_step": 1, "found": True}
    assert (
        done["metrics"]["val_loss"]["last"] == {"value": 0.7, "step": 2} and done["metrics"]["val_loss"]["points"] == 3
    )
    assert done["metrics"]["accuracy"]["best_mode"] == "max"
    assert "accuracy: 0.75" in [line["text"] for line in done["log_tail"]] and done["first_error"] is None
    assert float(done["cost"]["total"]) >= 0 and done["times"]["running_seconds"] > 0

    crashed = docs[1]
    assert crashed["state"] == "failed" and crashed["failure_class"] == "user" and crashed["exit_code"] == 1
    assert crashed["diagnosis"]["category"] == "python_exception", crashed["diagnosis"]
    assert "negative" in crashed["diagnosis"]["summary"]
    assert any("ValueError: the learning rate is negative" in line["text"] for line in crashed["log_tail"])
    assert crashed["first_error"]["text"].startswith("Traceback")
    assert crashed["objective"]["found"] is False

    code, out, _ = hangar("result", str(crash))
    assert code == 0 and "python_exception" in out and "ValueError" in out
    code, out, _ = hangar("metrics", str(train), "--json")
    assert [p[:2] for p in json.loads(out)["series"]["val_loss"]] == [[0, 0.9], [1, 0.5], [2, 0.7]]
    code, out, _ = hangar("compare", str(train), str(crash), "--json")
    compared = json.loads(out)
    assert code == 0 and {row["field"] for row in compared["spec_differences"]} >= {"command", "metrics_from_log"}
    assert compared["outcome"]["state"] == {"a": "succeeded", "b": "failed"}


def test_a_wait_that_times_out_exits_124_with_the_document(hangar, tmp_path):
    sleeper = submit(hangar, tmp_path, "sleeper", "import time; time.sleep(60)")
    code, out, err = hangar("wait", str(sleeper), "--timeout", "1", "--json")
    assert code == 124, err
    doc = json.loads(out)
    assert doc["id"] == sleeper and not doc["final"] and "still not ended" in err
    assert hangar("cancel", str(sleeper))[0] == 0


SWEEP = """
name: lr
max_parallel: 2
objective: {{metric: val_loss, mode: min}}
base:
  command: [{py}, -c, "import os; print('val_loss:', abs(float(os.environ['LR']) - 0.01), flush=True)"]
  metrics_from_log: '(?P<name>val_loss): (?P<value>\\S+)'
  max_runtime_seconds: 60
grid:
  env.LR: ["0.1", "0.01", "0.5"]
"""


def test_a_sweep_runs_its_variants_and_names_the_best_from_the_json(hangar, tmp_path, stack):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP.format(py=PY))
    code, out, err = hangar("sweep", "-f", str(path), "--json", "-p", "default")
    assert code == 0, err
    sweep = json.loads(out)
    assert sweep["variants"] == 3 and sweep["counts"] == {"queued": 2, "pending": 1}

    code, out, _ = hangar("sweep", "-f", str(path), "--json", "-p", "default")  # sent again: the same sweep
    assert code == 0 and json.loads(out)["id"] == sweep["id"]
    runs = []
    for _ in range(120):
        status = json.loads(hangar("sweep", "status", str(sweep["id"]), "--json")[1])
        runs = status["runs"]
        if status["state"] == "done":
            break
        time.sleep(0.5)
    assert status["state"] == "done" and sorted(r["state"] for r in runs) == ["succeeded"] * 3, status
    assert len({r["job"] for r in runs}) == 3  # each variant once, though the file was sent twice

    code, out, _ = hangar("sweep", "best", str(sweep["id"]), "--json")
    best = json.loads(out)
    assert code == 0 and best["params"] == {"env.LR": "0.01"} and best["objective"] == 0.0
    assert [r["params"]["env.LR"] for r in runs] == ["0.01", "0.1", "0.5"]  # ranked best first

    path.write_text(SWEEP.format(py=PY).replace('["0.1", "0.01", "0.5"]', "[]"))
    code, _, err = hangar("sweep", "-f", str(path), "-p", "default")
    assert code == 5 and "grid.env.LR" in err and "non-empty list" in err
