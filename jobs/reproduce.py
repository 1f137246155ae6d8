"""What reproduces a job, "run again", and comparing two jobs side by side."""

import json
import re

SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
MASK = "••••••"
# Spec fields a clone copies and a comparison shows, in order.
SPEC_FIELDS = [
    "command",
    "env",
    "gpus_per_node",
    "nodes",
    "gpu_type",
    "priority",
    "max_runtime_seconds",
    "code_version",
    "environment",
    "requirements",
    "python_version",
    "launcher",
    "config",
    "data_refs",
    "objective",
    "metrics_from_log",
]


def spec_value(job, name: str):
    if name == "environment":
        return job.environment.name if job.environment else ""
    return getattr(job, name)


def masked_env(env: dict) -> dict:
    return {k: (MASK if SECRET_NAME.search(k) else v) for k, v in env.items()}


def record(job) -> dict:
    """The reproduce record: spec (secrets masked) and where each attempt ran."""
    spec = {name: spec_value(job, name) for name in SPEC_FIELDS}
    spec["env"] = masked_env(job.env)
    spec["placement"] = [
        {
            "attempt": a.number,
            "node": a.node.name,
            "gpu_type": a.node.gpu_model,
            "gpu_indices": a.gpu_indices,
            # Every rank's node and GPUs, rank 0 first (a multi-node attempt ran on several).
            "ranks": [{"rank": r["rank"], "node": r["node"] or a.node.name, "gpu_indices": r["gpus"]} for r in a.ranks],
            # Its cached environment as rank 0's node resolved it: hash and exact packages.
            **({"environment": a.environment} if a.environment else {}),
        }
        for a in job.attempts.select_related("node")
    ]
    spec["mlflow_run_id"] = job.mlflow_run_id
    spec["code"] = code_record(job)
    from jobs import pipelines  # it submits through jobs/submission.py, which imports this module's callers

    if (stage := pipelines.record(job)) is not None:
        spec["pipeline"] = stage  # the run, the stage, the upstream stages' jobs
    return spec


def code_record(job) -> dict | None:
    """Its code snapshot and git facts (None: submitted without code); `available` is
    False once retention deleted the snapshot."""
    if not job.code:
        return None
    return {**job.code, "available": job.snapshot_id is not None, "diff": job.code_diff}


def clone_data(job) -> dict:
    """A submission that runs the same spec again (through the usual validation and budget check)."""
    data = {name: spec_value(job, name) for name in SPEC_FIELDS}
    data.update(
        project=job.project.slug,
        name=job.name,
        secret_env=job.secret_env,
        volumes=[{"name": v["name"], "mode": v["mode"]} for v in job.volumes],
        preemptible=job.preemptible,
        max_retries=job.max_retries,
        stop_on_hang=job.stop_on_hang,
        code=clone_code(job),
    )
    return {k: v for k, v in data.items() if v not in ("", None, []) and not (k == "objective" and not v)}


def clone_code(job) -> dict | None:
    """The same snapshot, commit, branch and diff again (a submit field: jobs/api/serializers.py)."""
    if not job.code:
        return None
    names = ("snapshot", "commit", "branch", "dirty", "diff_truncated")
    return {**{k: job.code[k] for k in names if k in job.code}, "diff": job.code_diff}


def diff(a: dict, b: dict, fields: list[str]) -> list[dict]:
    """Field by field: both values and whether they differ."""
    rows = []
    for name in fields:
        va, vb = a.get(name), b.get(name)
        rows.append({"field": name, "a": shown(va), "b": shown(vb), "differs": va != vb})
    return rows


def shown(value) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return "" if value is None else str(value)


def final_metrics(series: dict) -> dict:
    """The last logged value of each metric (by step, then time)."""
    return {key: points[-1][1] for key, points in series.items() if points}
