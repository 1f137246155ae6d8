"""End to end on a real stack: pipelines whose stages hand each other files through
HANGAR_PIPELINE_DIR, a failing stage that cancels the rest, a diamond whose middle stages
run at once, and a rerun from the last stage that reuses the earlier stages' output."""

import json
import sys
import textwrap
import time
from datetime import datetime

import pytest

from hangar import cli
from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e

PREPARE = "import os; open(os.path.join(os.environ['HANGAR_PIPELINE_DIR'], 'data.txt'), 'w').write('1 2 3 4')"
TRAIN = textwrap.dedent(
    """
    import os
    d = os.environ["HANGAR_PIPELINE_DIR"]
    numbers = [int(x) for x in open(os.path.join(d, "data.txt")).read().split()]
    open(os.path.join(d, "model.ckpt"), "w").write(str(sum(numbers) / len(numbers)))
    print("trained on", len(numbers), "for", os.environ["EPOCHS"], "epochs", flush=True)
    """
)
EVALUATE = textwrap.dedent(
    """
    import os, mlflow
    weight = float(open(os.path.join(os.environ["HANGAR_PIPELINE_DIR"], "model.ckpt")).read())
    mlflow.log_metric("score", weight)
    print("score", weight, flush=True)
    """
)
DIAMOND = """
name: diamond
project: default
defaults: {{environment: cuda}}
stages:
  split: {{command: ["{python}", -c, "print('split')"]}}
  left: {{needs: [split], command: ["{python}", -c, "import time; time.sleep(2)"]}}
  right: {{needs: [split], command: ["{python}", -c, "import time; time.sleep(2)"]}}
  join: {{needs: [left, right], command: ["true"]}}
"""
FINAL = ("succeeded", "failed", "cancelled")


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def wait_for_run(stack: LiveStack, run_id: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = stack.api("GET", f"/api/v1/pipelines/{run_id}/").json()
        if run["state"] != "running":
            return run
        time.sleep(0.2)
    raise AssertionError(f"pipeline run {run_id} still running after {timeout}s: {run}\n{stack.output()}")


def submit(stack: LiveStack, stages: dict, **extra) -> dict:
    body = {"project": "default", "name": "tiny", "defaults": {"environment": "cuda"}, "stages": stages, **extra}
    response = stack.api("POST", "/api/v1/pipelines/", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def window(stack: LiveStack, job_id: int) -> tuple[datetime, datetime]:
    attempt = stack.job(job_id)["attempts"][-1]
    return datetime.fromisoformat(attempt["running_at"]), datetime.fromisoformat(attempt["finished_at"])


def test_pipelines_run_in_order_share_a_directory_and_rerun_from_a_stage(tmp_path):
    from mlflow.tracking import MlflowClient

    with LiveStack(data_dir=str(tmp_path)) as stack:
        stages = {
            "prepare": {"command": python(PREPARE)},
            "train": {"needs": ["prepare"], "command": python(TRAIN)},
            "evaluate": {"needs": ["train"], "command": python(EVALUATE)},
        }
        first = wait_for_run(stack, submit(stack, stages, params={"EPOCHS": 2})["id"])
        assert first["state"] == "succeeded", (first, stack.output())
        jobs = {s["name"]: stack.job(s["job"]) for s in first["stages"]}
        assert window(stack, jobs["prepare"]["id"])[1] <= window(stack, jobs["train"]["id"])[0]
        assert window(stack, jobs["train"]["id"])[1] <= window(stack, jobs["evaluate"]["id"])[0]

        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        evaluate_run = client.get_run(jobs["evaluate"]["mlflow_run_id"])
        assert evaluate_run.data.metrics["score"] == 2.5
        assert evaluate_run.data.tags["mlflow.parentRunId"] == first["mlflow_run_id"]
        assert evaluate_run.data.tags["hangar.pipeline_stage"] == "evaluate"
        parent_status(tmp_path, first["mlflow_run_id"], "FINISHED")

        rerun = stack.api("POST", f"/api/v1/pipelines/{first['id']}/rerun/", json={"from_stage": "evaluate"})
        assert rerun.status_code == 201, rerun.text
        again = wait_for_run(stack, rerun.json()["id"])
        assert again["state"] == "succeeded", (again, stack.output())
        by_name = {s["name"]: s for s in again["stages"]}
        assert by_name["train"]["reused"] and by_name["train"]["job"] == jobs["train"]["id"]
        assert by_name["evaluate"]["job"] != jobs["evaluate"]["id"]
        new_evaluate = stack.job(by_name["evaluate"]["job"])
        assert client.get_run(new_evaluate["mlflow_run_id"]).data.metrics["score"] == 2.5  # train's checkpoint, reused
        assert again["directory"] != first["directory"]
        # Copied by evaluate's attempt on the node before its command (agent/pipelinecopy.py).
        assert again["copy"]["state"] == "done" and again["copy"]["bytes"] == again["copy"]["total"] > 0, again
        said = [line["text"] for line in stack.api("GET", f"/api/v1/jobs/{new_evaluate['id']}/logs/").json()["lines"]]
        assert any("of pipeline run" in line and line.startswith("[hangar] copied") for line in said), said

        page = httpx_page(stack, again["urls"]["page"])
        assert f'href="/jobs/{new_evaluate["id"]}/"' in page and "reused" in page


def parent_status(data_dir, run_id: str, status: str) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{data_dir}/mlflow.db")
    deadline = time.monotonic() + 30
    while client.get_run(run_id).info.status != status and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.get_run(run_id).info.status == status


def httpx_page(stack: LiveStack, path: str) -> str:
    import httpx

    with httpx.Client(base_url=stack.url, follow_redirects=True, timeout=30) as browser:
        login = browser.get("/login/")
        token = login.cookies["csrftoken"]
        browser.post("/login/", data={"username": "admin", "password": stack.password, "csrfmiddlewaretoken": token})
        response = browser.get(path)
        assert response.status_code == 200, response.text
        return response.text


def test_a_failing_stage_cancels_the_next_and_a_diamond_runs_its_middle_at_once(tmp_path, capsys):
    with LiveStack(data_dir=str(tmp_path)) as stack:
        failing = submit(
            stack,
            {
                "prepare": {"command": python(PREPARE)},
                "train": {"needs": ["prepare"], "command": python("raise SystemExit(3)")},
                "evaluate": {"needs": ["train"], "command": python(EVALUATE)},
            },
        )
        diamond_file = tmp_path / "diamond.yaml"
        diamond_file.write_text(DIAMOND.format(python=sys.executable))
        flags = ["--url", stack.url, "--token", stack.token, "--json"]
        failed = wait_for_run(stack, failing["id"])
        assert failed["state"] == "failed"
        states = {s["name"]: (s["state"], s["state_reason"]) for s in failed["stages"]}
        train_job = next(s["job"] for s in failed["stages"] if s["name"] == "train")
        assert states["train"][0] == "failed"
        reason = f"cancelled: job {train_job} failed, and this job needed it to succeed"
        assert states["evaluate"] == ("cancelled", reason)
        parent_status(tmp_path, failed["mlflow_run_id"], "FAILED")  # the pipeline's MLflow run ends as it did

        code = cli.main(["pipeline", "run", "-f", str(diamond_file), "--wait", "--timeout", "120", *flags])
        done = json.loads(capsys.readouterr().out)
        assert code == 0 and done["state"] == "succeeded", (done, stack.output())
        assert cli.main(["pipeline", "status", str(done["id"]), *flags[:4]]) == 0
        assert "join" in capsys.readouterr().out
        assert cli.main(["pipeline", "cancel", str(done["id"]), *flags]) == 5  # already over: refused, exit 5
        capsys.readouterr()

        long = submit(stack, {"slow": {"command": python("import time; time.sleep(60)")},
                              "after": {"needs": ["slow"], "command": ["true"]}})  # fmt: skip
        slow_job = long["stages"][0]["job"]
        stack.wait_for(slow_job, ("running",))
        refused = stack.api("POST", f"/api/v1/pipelines/{long['id']}/rerun/", json={"from_stage": "after"})
        assert refused.status_code == 409 and refused.json()["errors"][0]["field"] == "stages.slow", refused.text
        assert cli.main(["pipeline", "cancel", str(long["id"]), "--reason", "enough", *flags]) == 0
        assert json.loads(capsys.readouterr().out)["cancelled_stages"] == ["slow", "after"]
        stopped = wait_for_run(stack, long["id"], timeout=30)  # SIGTERM reached the running stage
        assert stopped["state"] == "cancelled"
        assert [(s["state"], s["state_reason"]) for s in stopped["stages"]][1] == ("cancelled", "enough")
        jobs = {s["name"]: s["job"] for s in done["stages"]}
        left, right, join = window(stack, jobs["left"]), window(stack, jobs["right"]), window(stack, jobs["join"])
        assert left[0] < right[1] and right[0] < left[1], (left, right)  # the two middle stages overlapped
        assert join[0] >= max(left[1], right[1])
