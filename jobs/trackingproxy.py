"""Hangar's MLflow tracking proxy: how a job's processes reach MLflow.

A job gets MLFLOW_TRACKING_URI = this proxy (HANGAR_TRACKING_PROXY_URL) and MLFLOW_TRACKING_TOKEN
= a credential of its attempt's (jobs/tracking.py `issue_credential`), which MLflow's client sends
as `Authorization: Bearer`. The proxy serves the part of MLflow's REST API a training script's
client uses, for the job's own run and experiment only, and writes them to the real store (the
embedded one in the data directory, which the sandbox hides, or a tracking server or database)
with MLflow's public client. Another run is refused (403 in MLflow's error shape), and so is
everything once the attempt has ended, but for the update MLflow's client sends at exit.
"""

import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from jobs import tracking
from jobs.models import Attempt
from jobs.models.states import ACTIVE_ATTEMPT_STATES
from portal import statements
from portal.auth import token_from_header
from portal.middleware import DATABASE_DOWN
from portal.models import hash_token

log = logging.getLogger("hangar.tracking")

# Tags that are Hangar's record of the job (its id, state, cost, diagnosis) or that would hang the
# job's run under another's in MLflow's UI: written by Hangar only.
RESERVED_TAG_PREFIX = "hangar."
RESERVED_TAGS = frozenset({"mlflow.parentRunId"})


@dataclass(frozen=True)
class Grant:
    """What one credential may reach: its attempt's job's run and experiment."""

    attempt_id: int
    number: int
    job_id: int
    run_id: str
    experiment_id: str
    live: bool  # the attempt has not ended
    ended_at: datetime | None


@dataclass(frozen=True)
class Asked:
    """What a request names: the runs (its run_id and run_uuid, and a batch's metrics' own), the
    experiment, the tags it writes and the logged models it attaches metrics or inputs to."""

    run_ids: frozenset[str] = frozenset()
    experiment_id: str = ""
    tag_keys: tuple[str, ...] = ()
    model_ids: frozenset[str] = frozenset()


class Refusal(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


SERVE, ACKNOWLEDGE = "serve", "acknowledge"


def decide(grant: Grant, endpoint: "Endpoint", asked: Asked, now: datetime, grace: timedelta) -> str:
    """SERVE, or ACKNOWLEDGE (what MLflow's client sends at exit, after its attempt ended: its
    run read, its update answered with nothing written, Hangar writes the run's end); raises
    Refusal otherwise."""
    if endpoint.target == "run":
        check_run(grant, asked.run_ids)
    elif asked.experiment_id != grant.experiment_id:
        raise Refusal(
            403,
            "PERMISSION_DENIED",
            f"job {grant.job_id}'s credential reaches only its own experiment {grant.experiment_id}, "
            f"not experiment {asked.experiment_id or '(none given)'}",
        )
    if asked.model_ids:
        # The store writes a metric's model_id onto that logged model, whoever's it is; a job
        # cannot make one of its own here (no model endpoints), so any it names is another's.
        raise Refusal(
            403,
            "PERMISSION_DENIED",
            f"model {sorted(asked.model_ids)[0]} is not job {grant.job_id}'s: Hangar's tracking proxy serves "
            "no logged models, so log metrics and inputs without one (no model_id, no set_active_model)",
        )
    if reserved := [key for key in asked.tag_keys if is_reserved(key)]:
        raise Refusal(
            403,
            "PERMISSION_DENIED",
            f"tag {reserved[0]!r} is Hangar's to write (names starting with {RESERVED_TAG_PREFIX!r}, "
            f"{', '.join(sorted(RESERVED_TAGS))}): use another name",
        )
    if grant.live:
        return SERVE
    if endpoint.at_exit and grant.ended_at is not None and now <= grant.ended_at + grace:
        return ACKNOWLEDGE
    raise Refusal(
        403,
        "PERMISSION_DENIED",
        f"attempt {grant.number} of job {grant.job_id} has ended: its MLflow credential no longer works "
        "(each attempt's processes get their own)",
    )


def check_run(grant: Grant, run_ids: frozenset[str]) -> None:
    if not run_ids:
        raise Refusal(400, "INVALID_PARAMETER_VALUE", "run_id is missing: name the job's run (MLFLOW_RUN_ID)")
    if others := sorted(run_ids - {grant.run_id}):
        raise Refusal(
            403,
            "PERMISSION_DENIED",
            f"job {grant.job_id}'s credential reaches only its own run {grant.run_id}, not run {others[0]}",
        )


def is_reserved(key: str) -> bool:
    return key.startswith(RESERVED_TAG_PREFIX) or key in RESERVED_TAGS


# --- the credential -----------------------------------------------------------------


@statements.query
def credential_of(pk: int):
    """An attempt's credential digests and state, with its job's run (one read per request)."""
    return Attempt.objects.filter(pk=pk).values_list(
        "tracking_digests", "state", "finished_at", "number", "job_id", "job__mlflow_run_id",
        "job__mlflow_experiment_id",
    )[:1]  # fmt: skip


def grant_for(authorization: str) -> Grant | None:
    """The grant of `Authorization: Bearer hgm_<attempt id>_<secret>`, None for anything else."""
    raw = token_from_header(authorization) or ""
    attempt_id, _, secret = raw.removeprefix(tracking.CREDENTIAL_PREFIX).partition("_")
    if not raw.startswith(tracking.CREDENTIAL_PREFIX) or not attempt_id.isdigit() or len(attempt_id) > 18 or not secret:
        return None
    row = credential_of.first(pk=int(attempt_id))
    if row is None:
        return None
    digests, state, finished_at, number, job_id, run_id, experiment_id = row
    digest = hash_token(raw)
    if not run_id or not any(hmac.compare_digest(digest, known) for known in digests):
        return None
    live = state in ACTIVE_ATTEMPT_STATES
    return Grant(int(attempt_id), number, job_id, run_id, experiment_id, live, finished_at)


# --- MLflow's endpoints -------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    method: str
    proto: str  # the request's message in mlflow.protos.service_pb2
    serve: Callable  # (client, run or experiment id, request message) -> response message
    target: str = "run"  # "run" or "experiment": what the request must name
    at_exit: bool = False  # what MLflow's client sends as its process exits


def _log_metric(client, run_id: str, msg):
    optional = {name: getattr(msg, name) for name in ("dataset_name", "dataset_digest") if msg.HasField(name)}
    client.log_metric(run_id, msg.key, msg.value, timestamp=msg.timestamp, step=msg.step, **optional)
    return msg.Response()


def _log_batch(client, run_id: str, msg):
    from mlflow.entities import Metric, Param, RunTag

    metrics = [Metric.from_proto(metric) for metric in msg.metrics]
    params = [Param.from_proto(param) for param in msg.params]
    client.log_batch(run_id, metrics=metrics, params=params, tags=[RunTag.from_proto(tag) for tag in msg.tags])
    return msg.Response()


def _log_param(client, run_id: str, msg):
    client.log_param(run_id, msg.key, msg.value)
    return msg.Response()


def _set_tag(client, run_id: str, msg):
    client.set_tag(run_id, msg.key, msg.value)
    return msg.Response()


def _delete_tag(client, run_id: str, msg):
    client.delete_tag(run_id, msg.key)
    return msg.Response()


def _log_inputs(client, run_id: str, msg):
    from mlflow.entities import DatasetInput, LoggedModelInput

    datasets = [DatasetInput.from_proto(dataset) for dataset in msg.datasets]
    client.log_inputs(run_id, datasets=datasets, models=[LoggedModelInput.from_proto(model) for model in msg.models])
    return msg.Response()


def _update_run(client, run_id: str, msg):
    from mlflow.entities import RunStatus

    status = RunStatus.to_string(msg.status) if msg.HasField("status") else None
    if status is not None or msg.run_name:
        client.update_run(run_id, status=status, name=msg.run_name or None)
    return msg.Response(run_info=client.get_run(run_id).info.to_proto())


def _get_run(client, run_id: str, msg):
    return msg.Response(run=client.get_run(run_id).to_proto())


def _metric_history(client, run_id: str, msg):
    return msg.Response(metrics=[metric.to_proto() for metric in client.get_metric_history(run_id, msg.metric_key)])


def _get_experiment(client, experiment_id: str, msg):
    return msg.Response(experiment=client.get_experiment(experiment_id).to_proto())


ENDPOINTS = {
    "runs/log-metric": Endpoint("POST", "LogMetric", _log_metric),
    "runs/log-batch": Endpoint("POST", "LogBatch", _log_batch),
    "runs/log-parameter": Endpoint("POST", "LogParam", _log_param),
    "runs/set-tag": Endpoint("POST", "SetTag", _set_tag),
    "runs/delete-tag": Endpoint("POST", "DeleteTag", _delete_tag),
    "runs/log-inputs": Endpoint("POST", "LogInputs", _log_inputs),
    "runs/update": Endpoint("POST", "UpdateRun", _update_run, at_exit=True),
    "runs/get": Endpoint("GET", "GetRun", _get_run, at_exit=True),
    "metrics/get-history": Endpoint("GET", "GetMetricHistory", _metric_history),
    "experiments/get": Endpoint("GET", "GetExperiment", _get_experiment, target="experiment"),
}
SERVED = ", ".join(f"{e.method} {name}" for name, e in ENDPOINTS.items())


def parse(request: HttpRequest, endpoint: Endpoint):
    """The request's message: the JSON body of a POST, the query of a GET (as MLflow's client sends them)."""
    from mlflow.protos import service_pb2
    from mlflow.utils.proto_json_utils import parse_dict

    message = getattr(service_pb2, endpoint.proto)()
    try:
        if endpoint.method == "GET":
            fields = {key: request.GET.getlist(key) for key in request.GET}
            data = {key: values if len(values) > 1 else values[0] for key, values in fields.items()}
        else:
            data = json.loads(request.body or b"{}")
        if not isinstance(data, dict):
            raise ValueError("the body is not a JSON object")
        parse_dict(data, message)
    except Exception as exc:  # malformed JSON, a wrong type, an unknown enum value
        raise Refusal(400, "MALFORMED_REQUEST", f"{endpoint.proto}: cannot read the request: {exc}"[:500]) from None
    return message


def asked_by(message, endpoint: Endpoint) -> Asked:
    """Every id and tag the message names, nested ones included (a batch's metrics carry a run
    and a model each): the store is given the grant's run, but a model id it would follow."""
    if endpoint.target == "experiment":
        return Asked(experiment_id=message.experiment_id)
    batch = list(message.metrics) if endpoint.proto == "LogBatch" else []
    run_ids = {getattr(message, "run_id", ""), getattr(message, "run_uuid", ""), *(m.run_id for m in batch)}
    inputs = getattr(message, "models", ())  # LogInputs: models its run takes as inputs
    model_ids = {getattr(message, "model_id", ""), *(m.model_id for m in batch), *(m.model_id for m in inputs)}
    keys: tuple[str, ...] = ()
    if endpoint.proto in ("SetTag", "DeleteTag"):
        keys = (message.key,)
    elif endpoint.proto == "LogBatch":
        keys = tuple(tag.key for tag in message.tags)
    return Asked(run_ids=frozenset(run_ids - {""}), tag_keys=keys, model_ids=frozenset(model_ids - {""}))


def ended_grace() -> timedelta:
    # A rank learns of its attempt's end within a lease and is killed within the kill grace.
    return timedelta(seconds=settings.HANGAR_KILL_GRACE_SECONDS + settings.HANGAR_LEASE_SECONDS)


@csrf_exempt
def mlflow_api(request: HttpRequest, name: str) -> HttpResponse:
    """/api/mlflow/api/2.0/mlflow/<name>: one of MLflow's endpoints, for the caller's own run."""
    try:
        return answer(request, name)
    except Refusal as refusal:
        return error(refusal.status, refusal.code, refusal.message)
    except DATABASE_DOWN as exc:  # MLflow's client retries a 503
        log.warning("tracking proxy: Hangar's database is unavailable: %s", exc)
        return error(503, "TEMPORARILY_UNAVAILABLE", "Hangar's database is unavailable; retry shortly")


def answer(request: HttpRequest, name: str) -> HttpResponse:
    if (grant := grant_for(request.headers.get("Authorization", ""))) is None:
        raise Refusal(
            401,
            "UNAUTHENTICATED",
            "MLFLOW_TRACKING_TOKEN is missing or unknown: Hangar's tracking proxy answers a job's own processes, "
            "with the MLFLOW_TRACKING_TOKEN their attempt was given",
        )
    endpoint = ENDPOINTS.get(name)
    if endpoint is None or endpoint.method != request.method:
        raise Refusal(
            404,
            "ENDPOINT_NOT_FOUND",
            f"{request.method} {name} is not served: Hangar's tracking proxy serves a job's own run only ({SERVED}); "
            "read other runs in Hangar's API or MLflow's UI",
        )
    message = parse(request, endpoint)
    verdict = decide(grant, endpoint, asked_by(message, endpoint), timezone.now(), ended_grace())
    if verdict == ACKNOWLEDGE and endpoint.method == "POST":
        return write_nothing(grant, message)
    # The store is called with the grant's own ids, never the request's (checked equal above).
    return through(endpoint, grant.run_id if endpoint.target == "run" else grant.experiment_id, message)


def write_nothing(grant: Grant, message) -> HttpResponse:
    """The exit's update of an ended attempt: answered as written; the run's end is Hangar's to write."""
    from mlflow.protos.service_pb2 import RunInfo

    info = RunInfo(run_id=grant.run_id, run_uuid=grant.run_id, experiment_id=grant.experiment_id)
    return respond(message.Response(run_info=info))


def through(endpoint: Endpoint, target: str, message) -> HttpResponse:
    """The call, made on the real store with MLflow's client; its errors in MLflow's shape."""
    from mlflow.exceptions import MlflowException

    try:
        return respond(endpoint.serve(tracking.client(), target, message))
    except MlflowException as exc:
        status = exc.get_http_status_code()
        if status < 500:  # about the job's own request (a parameter logged twice, a bad value)
            return error(status, exc.error_code, exc.message)
        log.warning("tracking proxy: %s for %s failed: %s", endpoint.proto, target, exc)
    except Exception as exc:  # the store unreachable: its address (and credentials) stay here
        log.warning("tracking proxy: %s for %s failed: %s: %s", endpoint.proto, target, type(exc).__name__, exc)
    return error(503, "TEMPORARILY_UNAVAILABLE", "Hangar's MLflow store is unavailable; retry shortly")


def respond(message) -> HttpResponse:
    from mlflow.utils.proto_json_utils import message_to_json

    return HttpResponse(message_to_json(message), content_type="application/json")


def error(status: int, code: str, message: str) -> HttpResponse:
    """MLflow's error shape, which its client raises as MlflowException with the code and message."""
    return HttpResponse(
        json.dumps({"error_code": code, "message": message}), status=status, content_type="application/json"
    )
