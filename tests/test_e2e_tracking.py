"""End to end: a real job logs metrics with `mlflow` from inside its process, with no set-up;
Hangar made the run, tagged it, closed it with the job's cost, and the job page's chart data has the points."""

import sys
import textwrap
import time

import pytest

from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e

TRAIN = textwrap.dedent(
    """
    import mlflow
    for step in range(5):
        mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
    mlflow.log_metric("accuracy", 0.9, step=4)
    print("logged", flush=True)
    """
)


def test_a_job_logs_metrics_to_its_run_with_no_set_up(tmp_path):
    from mlflow.tracking import MlflowClient

    with LiveStack(data_dir=str(tmp_path)) as stack:
        job = stack.submit([sys.executable, "-c", TRAIN], name="train", code_version="deadbeef", environment="cuda")
        done = stack.wait_for(job["id"], ("succeeded", "failed", "cancelled"), timeout=120)
        assert done["state"] == "succeeded", stack.output()
        assert done["mlflow_run_id"] and not done["tracking_error"]

        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        deadline = time.monotonic() + 30
        run = client.get_run(done["mlflow_run_id"])
        # The notifier writes the cost with the final status, after the attempt's end. The job's
        # own MLflow ends the run (FINISHED) as its process exits, before that: wait for the cost.
        while "hangar.cost" not in run.data.tags and time.monotonic() < deadline:
            time.sleep(0.2)
            run = client.get_run(done["mlflow_run_id"])
        tags = run.data.tags
        assert tags["hangar.job_id"] == str(job["id"]) and tags["hangar.project"] == "default"
        assert tags["hangar.code_version"] == "deadbeef" and tags["hangar.nodes"] == "node-a"
        assert tags["hangar.user"] == "admin" and "hangar.cost" in tags
        assert run.info.status == "FINISHED"
        assert client.get_experiment(run.info.experiment_id).name == "hangar/default"

        chart = stack.api("GET", f"/api/v1/jobs/{job['id']}/metrics/").json()
        assert chart["available"] and chart["final"]
        assert [p[:2] for p in chart["series"]["loss"]] == [[i, 1.0 / (i + 1)] for i in range(5)]
        loss = next(trace for trace in chart["figure"]["data"] if trace["name"] == "loss")
        assert loss["x"] == [0, 1, 2, 3, 4] and loss["y"] == [1.0 / (i + 1) for i in range(5)]
