"""MLflow: an experiment per project, a run per job, handed to the job's processes.

The run is created when the job's first attempt starts (by the agent, in
`Runner.job_env`); later attempts reuse it and record their number and node as
tags. After each attempt's end the notifier (`manage.py notifier`, on the
`hangar.tracking` queue) writes the job's state and cost as tags and, when the
job is over, the run's final status: MLflow's store took ~8 ms of the ~50 ms of
agent CPU an `echo` attempt cost, on the process that starts the next job. MLflow
being down never stops a job: the reason is kept on the job (`tracking_error`)
and shown on its page. On a database store both writes are Hangar's own, one
transaction each on MLflow's tables (`create_run`, `update_run`); a tracking
server gets MLflow's client calls.

A job's processes never get the store: they reach MLflow through Hangar's tracking proxy
(jobs/trackingproxy.py) with a credential of their attempt's, which writes only the job's run.

Named tracking.py, not mlflow.py, so it does not shadow the mlflow package.
"""

import contextlib
import fcntl
import json
import logging
import os
import secrets
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

from celery.signals import worker_ready
from django.conf import settings

from fleet.models import NODE_QUEUE_PREFIX
from jobs.models import FINAL_JOB_STATES, Job, PipelineRun
from portal import statements
from portal.celery import freeze_what_is_loaded
from portal.models import hash_token

log = logging.getLogger("hangar.tracking")

_client = None
_client_lock = threading.Lock()

RUN_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
QUEUE = "hangar.tracking"  # taken by the notifier's worker
MAX_POINTS = 5000


def enabled() -> bool:
    return settings.HANGAR_MLFLOW


def client():
    """One MlflowClient per process. Its store is opened under `store_creation_lock`: the
    first use of a database store creates its tables, which two processes must not do at once.

    MLflow is imported here, under `_client_lock`, and nowhere before this returns: every other
    MLflow import in Hangar comes after a call to it. Two threads importing MLflow's package at
    once (the agent's warm-up, and a first job's `from mlflow... import`) meet in its circular
    imports: Python breaks the deadlock by handing one of them a half-made module, and the
    agent's every later job then ran untracked ("partially initialized module 'mlflow'")."""
    global _client
    with _client_lock:
        if _client is None:
            # Fail fast when a tracking server is down, instead of MLflow's minutes of retries.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
            from mlflow.tracking import MlflowClient

            uri = settings.MLFLOW_TRACKING_URI
            if uri.startswith("sqlite:"):
                write_ahead_log_for_sqlite()
            with store_creation_lock(uri):
                new = MlflowClient(tracking_uri=uri)
                new.search_experiments(max_results=1)  # opens (and, the first time, creates) the store
            _client = new
        return _client


STORE_LOCK_KEY = 0x48616E676172  # "Hangar": PostgreSQL's advisory lock on the MLflow store's database
STORE_LOCK_WAIT_SECONDS = 60.0  # making MLflow's tables takes seconds


@contextlib.contextmanager
def store_creation_lock(uri: str):
    """Held while a process opens the MLflow store for the first time. A file lock in the data
    directory covers this host's processes (all an embedded SQLite store has). A store in
    PostgreSQL is shared by every host's agents, scheduler, notifier and web: the lock
    is also taken in that database (an advisory lock, released with its connection), or two
    hosts create MLflow's tables at once and one fails on a duplicate type or row. A tracking
    server creates its own store.

    The advisory lock is waited for STORE_LOCK_WAIT_SECONDS at most: anyone who can reach the
    store's database can take it (a job given its URI too), and held for good it would stop
    every Hangar process's first use of MLflow, and with it every job's start. Held that long,
    it is no table creation under way: the store is opened without it."""
    with open(settings.DATA_DIR / "mlflow.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not uri.startswith("postgresql"):  # postgresql:// or postgresql+driver://
            yield
            return
        from sqlalchemy import create_engine, text
        from sqlalchemy.pool import NullPool

        engine = create_engine(uri, poolclass=NullPool)
        try:
            with engine.connect() as held:
                take = text("SELECT pg_try_advisory_lock(:key)")
                deadline = time.monotonic() + STORE_LOCK_WAIT_SECONDS
                while not held.execute(take, {"key": STORE_LOCK_KEY}).scalar():
                    if time.monotonic() > deadline:
                        log.warning(
                            "MLflow's store lock is held for over %.0f s: opened without it", STORE_LOCK_WAIT_SECONDS
                        )
                        break
                    time.sleep(0.1)
                held.commit()  # the lock is the session's: no transaction stays open beside the store's
                yield
        finally:
            engine.dispose()


def write_ahead_log_for_sqlite() -> None:
    """An embedded MLflow store is one SQLite file that every agent, the notifier and the web
    write: in SQLite's default journal a writer waits for every reader and each commit syncs
    the disk several times, so a preflight waited seconds on the store's lock when jobs
    started in bursts. The store's connections are put in WAL mode (readers beside the
    writer, kept in the file) with a sync at checkpoints only, as Hangar's own database is.
    They also get what MLflow's sessions set on each use (foreign keys, a 20 s wait for the
    writer's turn): Hangar's own writes (create_run, update_run) go through the engine, not them.
    Only MLflow uses SQLAlchemy in Hangar's processes: the listener sees no other engine."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    if event.contains(Engine, "connect", _sqlite_pragmas):
        return
    event.listen(Engine, "connect", _sqlite_pragmas)


def _sqlite_pragmas(connection, _record) -> None:
    import sqlite3

    if not isinstance(connection, sqlite3.Connection):
        return
    try:  # changing the mode waits for the file to itself; an old Hangar holding it open keeps the old one
        connection.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError as exc:
        log.warning("MLflow's store stays in its journal mode: %s", exc)
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.execute("PRAGMA foreign_keys=ON")
    connection.execute("PRAGMA busy_timeout=20000")


_experiments: dict[tuple[str, str], Future] = {}  # each project's lookup, by one thread; its answer once done
_experiments_lock = threading.Lock()


@worker_ready.connect
def warm_up(sender=None, **_) -> None:
    """Open the store when an agent (or the notifier) starts rather than in its first job's
    preflight: importing MLflow and creating an embedded store take seconds."""
    if enabled() and uses_mlflow_at_once(sender):
        threading.Thread(target=_warm, daemon=True, name="mlflow-warm-up").start()


def uses_mlflow_at_once(consumer) -> bool:
    """Whether a worker's work uses MLflow as soon as it comes: an agent's (its node's queue: it
    makes each job's run) or the notifier's (it updates and ends them). The scheduler's does not:
    warmed up, it held MLflow and SQLAlchemy for good (221 MB resident against 125); it loads
    them only if its reconciler ends a pipeline's stage, whose parent run is then closed."""
    queues = {queue.name for queue in getattr(getattr(consumer, "task_consumer", None), "queues", ())}
    return QUEUE in queues or any(name.startswith(NODE_QUEUE_PREFIX) for name in queues)


def _warm() -> None:
    try:
        client()
    except Exception as exc:  # the first job records the reason on itself
        log.warning("MLflow at %s is not available yet: %s", settings.MLFLOW_TRACKING_URI, exc)
        return
    freeze_what_is_loaded()  # MLflow and SQLAlchemy, loaded for good


def experiment_id(project_slug: str) -> str:
    """The project's experiment, created on first use; remembered per process (it saves a round trip per job).
    Looked up by one thread while the others that need it meanwhile wait for its answer, or
    its error (MLflow down: one wait for its timeout, not one each in turn): an agent given
    eight jobs at once looked it up eight times (18-198 ms each, four agents at once), and
    created it as many times when it was new."""
    key = (settings.MLFLOW_TRACKING_URI, project_slug)
    with _experiments_lock:
        lookup = _experiments.get(key)
        mine = lookup is None
        if mine:
            lookup = _experiments[key] = Future()
    if mine:
        try:
            lookup.set_result(_find_or_create_experiment(f"hangar/{project_slug}", project_slug))
        except BaseException as exc:
            with _experiments_lock:
                del _experiments[key]  # the next call looks again
            lookup.set_exception(exc)
    return lookup.result()  # raises the lookup's error


def _find_or_create_experiment(name: str, project_slug: str) -> str:
    c = client()  # first: it imports MLflow
    from mlflow.exceptions import MlflowException

    found = c.get_experiment_by_name(name)
    if found is not None and found.lifecycle_stage == "active":
        return found.experiment_id
    if found is not None:  # deleted in the MLflow UI: bring it back rather than fail every job
        c.restore_experiment(found.experiment_id)
        return found.experiment_id
    try:
        return c.create_experiment(name, tags={"hangar.project": project_slug})
    except MlflowException:  # created meanwhile by another process
        return c.get_experiment_by_name(name).experiment_id


def run_tags(job: Job, attempt) -> dict[str, str]:
    return {
        "hangar.job_id": str(job.pk),
        "hangar.project": job.project.slug,
        "hangar.user": job.submitted_by.username,
        "hangar.gpu_type": attempt.node.gpu_model,
        "hangar.nodes": attempt.node.name,
        "hangar.attempt": str(attempt.number),
        "hangar.code_version": job.code_version,
        "hangar.environment": job.environment.name if job.environment else "",
        "hangar.command": json.dumps(job.command),
        "mlflow.user": job.submitted_by.username,
        "mlflow.source.git.commit": job.code_version,
    }


def job_env(job: Job, attempt) -> dict[str, str]:
    """MLFLOW_* variables for an attempt's processes: Hangar's tracking proxy, a credential of
    this attempt's for it, the job's run and experiment. Never the store's URI: with it a job
    could write any run (and a sandboxed job cannot open the embedded one). Empty when MLflow
    fails (the reason kept on the job) or the job cannot reach the proxy (`left_out`)."""
    if not enabled():
        return {}
    try:
        if not job.mlflow_run_id:
            exp = experiment_id(job.project.slug)
            tags = {**run_tags(job, attempt), **stage_tags(job, exp)}
            run_id = create_run(exp, f"job-{job.pk} {job.name}", tags)
            won = run_recorded.update(pk=job.pk, experiment_id=exp, run_id=run_id)
            if won:
                job.mlflow_experiment_id, job.mlflow_run_id = exp, run_id
            else:  # another rank's agent created the job's run first: use that one
                client().delete_run(run_id)
                job.refresh_from_db(fields=["mlflow_experiment_id", "mlflow_run_id"])
        else:  # a later attempt: its number and node on the job's run, which runs again
            update_run(job.mlflow_run_id, {key: str(value) for key, value in run_tags(job, attempt).items()}, "RUNNING")
    except Exception as exc:  # MLflow down or misconfigured: the job runs without tracking
        _record_error(job.pk, exc)
        return {}
    # The run is made all the same: metrics the agent reads from the job's output go to it.
    if left_out(job) or (credential := issue_credential(attempt)) is None:
        return {}
    return {
        "MLFLOW_TRACKING_URI": settings.HANGAR_TRACKING_PROXY_URL,
        "MLFLOW_TRACKING_TOKEN": credential,
        "MLFLOW_EXPERIMENT_ID": job.mlflow_experiment_id,
        "MLFLOW_RUN_ID": job.mlflow_run_id,
        # The client would print a link to the proxy's address at the run's end, where no UI is
        # served (the job's page links to the run, in MLflow's UI when HANGAR_MLFLOW_UI_URL is set).
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    }


CREDENTIAL_PREFIX = "hgm_"


def left_out(job: Job) -> str:
    """Why a job's processes get no MLflow variables though its run is made ('' when they get
    them): a project whose network is `none` runs its jobs with loopback only, which does not
    reach the web tier. The agent says it once in the attempt's log."""
    if job.project.network == "none":
        return (
            "MLflow: this project's network is `none`, so its jobs cannot reach Hangar's tracking proxy: "
            "no MLFLOW_* variables are set (metrics printed to the log are still read into the job's run "
            "when the job has metrics_from_log)"
        )
    return ""


def issue_credential(attempt) -> str | None:
    """A new credential for one rank of an attempt: `hgm_<attempt id>_<secret>`. Only its
    SHA-256 is stored, on the attempt (a rank each); the proxy finds the attempt by the id and
    checks the digest. None when the attempt has ended meanwhile."""
    raw = f"{CREDENTIAL_PREFIX}{attempt.pk}_{secrets.token_urlsafe(32)}"
    return raw if attempt.add_tracking_digest(hash_token(raw)) else None


@statements.update
def run_recorded(pk: int, experiment_id: str, run_id: str):
    """The job's MLflow run, recorded by the first of its ranks to make one."""
    return Job.objects.filter(pk=pk, mlflow_run_id=""), {
        "mlflow_experiment_id": experiment_id,
        "mlflow_run_id": run_id,
        "tracking_error": "",
    }


@statements.query
def run_update_of(pk: int):
    """What a job's run is told after an attempt's end: the job's state, its run and its cost."""
    return Job.objects.filter(pk=pk).values_list("state", "mlflow_run_id", "cost__cost")[:1]


def database_store():
    """MLflow's SQLAlchemy store when the tracking URI is a database (Hangar writes its rows
    itself), None for a tracking server (MLflow's client calls it)."""
    store = client()._tracking_client.store  # first: it imports MLflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    return store if isinstance(store, SqlAlchemyStore) else None


def create_run(experiment: str, name: str, tags: dict[str, str]) -> str:
    """A new RUNNING run's id. On a database store (the embedded default, or PostgreSQL) the run
    and its tags are one insert in one transaction: MLflow's `create_run` also reads the
    experiment with all its tags and reads the new run back with its inputs, which took ~60 %
    of its time and ~20 % of an agent's CPU for short jobs. Its rows are MLflow's own (its
    models, as its `create_run` makes them), written on a connection of the store's engine by
    statements compiled once (`run_statements`): an ORM session (MLflow's ManagedSessionMaker,
    three PRAGMAs each) cost ~45 % more CPU. A tracking server takes the client's call."""
    if (store := database_store()) is None:
        return client().create_run(experiment, run_name=name, tags=tags).info.run_id
    from mlflow.entities import LifecycleStage, RunStatus, SourceType
    from mlflow.exceptions import MlflowException
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME, MLFLOW_USER
    from mlflow.utils.uri import append_to_uri_path

    run_id = uuid.uuid4().hex
    sql = run_statements(store.engine)
    with raw_transaction(store.engine) as cursor:
        cursor.execute(sql.experiment.text, sql.experiment.values({"experiment_id": int(experiment)}))
        found = cursor.fetchone()
        if found is None or found[0] != LifecycleStage.ACTIVE:
            forget_experiment(experiment)  # the next job's look-up restores it (or makes it anew)
            raise MlflowException(f"MLflow experiment {experiment} was deleted: the project's next job restores it")
        run = {
            "name": name,
            "artifact_uri": append_to_uri_path(found[1], run_id, SqlAlchemyStore.ARTIFACTS_FOLDER_NAME),
            "run_uuid": run_id,
            "experiment_id": int(experiment),
            "source_type": SourceType.to_string(SourceType.UNKNOWN),
            "source_name": "",
            "entry_point_name": "",
            "user_id": tags.get(MLFLOW_USER, "unknown"),
            "status": RunStatus.to_string(RunStatus.RUNNING),
            "start_time": int(time.time() * 1000),
            "end_time": None,
            "deleted_time": None,
            "source_version": "",
            "lifecycle_stage": LifecycleStage.ACTIVE,
        }
        cursor.execute(sql.run.text, sql.run.values(run))
        rows = [{"run_uuid": run_id, "key": k, "value": v} for k, v in {**tags, MLFLOW_RUN_NAME: name}.items()]
        cursor.executemany(sql.tag.text, [sql.tag.values(row) for row in rows])
    return run_id


@dataclass(frozen=True)
class RawStatement:
    """One statement's SQL in a store's own dialect and paramstyle, and how its values are passed."""

    text: str
    order: tuple[str, ...] | None  # a positional paramstyle's order of the values; None: by name

    def values(self, named: dict) -> dict | list:
        return named if self.order is None else [named[name] for name in self.order]


@dataclass(frozen=True)
class RunStatements:
    experiment: RawStatement  # the experiment's lifecycle stage and artifact location
    run: RawStatement  # the run's row
    tag: RawStatement  # one tag's row


RUN_COLUMNS = (
    "name", "artifact_uri", "run_uuid", "experiment_id", "source_type", "source_name", "entry_point_name",
    "user_id", "status", "start_time", "end_time", "deleted_time", "source_version", "lifecycle_stage",
)  # fmt: skip


_run_statements: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # by the store's engine


def run_statements(engine) -> RunStatements:
    """create_run's statements, compiled by SQLAlchemy once per store (the SQL and paramstyle of
    its dialect) and then run on the store's DBAPI connection: each run through SQLAlchemy's
    execution (its contexts, events and result objects) cost ~3x the CPU of the statement itself
    (create_run: 0.43 -> 0.26 ms of CPU here, on SQLite; on the agent's path to each job's start,
    measured in a running stack, 1.4 ms of its CPU beside the start's other work). The values are
    strings, integers and NULLs, which every DBAPI driver takes as they are: a column whose type
    would convert its value (a bind processor) is refused when the statements are compiled."""
    if (found := _run_statements.get(engine)) is None:
        found = _run_statements[engine] = compile_run_statements(engine.dialect)
    return found


def compile_run_statements(dialect) -> RunStatements:
    from mlflow.store.tracking.dbmodels.models import SqlExperiment, SqlRun, SqlTag
    from sqlalchemy import bindparam, insert, select

    def compiled(statement, **keys) -> RawStatement:
        sql = statement.compile(dialect=dialect, **keys)
        if any(bind.type.dialect_impl(dialect).bind_processor(dialect) for bind in sql.binds.values()):
            raise NotImplementedError(f"a value of {sql.string!r} would need SQLAlchemy's conversion")
        return RawStatement(sql.string, tuple(sql.positiontup) if dialect.positional else None)

    look = select(SqlExperiment.lifecycle_stage, SqlExperiment.artifact_location)
    return RunStatements(
        experiment=compiled(look.where(SqlExperiment.experiment_id == bindparam("experiment_id"))),
        run=compiled(insert(SqlRun.__table__), column_keys=list(RUN_COLUMNS)),
        tag=compiled(insert(SqlTag.__table__), column_keys=["run_uuid", "key", "value"]),
    )


@contextlib.contextmanager
def raw_transaction(engine):
    """A cursor on one of the store engine's pooled DBAPI connections (checked as the engine checks
    them), committed at the end or rolled back, the connection then back in the pool."""
    connection = engine.raw_connection()
    try:
        cursor = connection.cursor()
        try:
            yield cursor
            connection.commit()
        except BaseException:
            connection.rollback()
            raise
        finally:
            cursor.close()
    finally:
        connection.close()


def forget_experiment(experiment: str) -> None:
    with _experiments_lock:
        for key, lookup in list(_experiments.items()):
            if lookup.done() and lookup.exception() is None and lookup.result() == experiment:
                del _experiments[key]


def stage_tags(job: Job, experiment: str) -> dict[str, str]:
    """A pipeline stage's run is nested under its pipeline run's parent run (made by its first stage)."""
    from jobs.pipelines import stage_run_by

    if (stage := stage_run_by(job)) is None:
        return {}
    return {
        "mlflow.parentRunId": parent_run_id(stage.run, experiment),
        "hangar.pipeline_run": str(stage.run_id),
        "hangar.pipeline_stage": stage.name,
    }


def parent_run_id(run: PipelineRun, experiment: str) -> str:
    if not run.mlflow_run_id:
        tags = {"hangar.pipeline_run": str(run.pk), "hangar.project": run.project.slug}
        parent = create_run(experiment, f"pipeline-{run.pk} {run.name}", tags)
        won = PipelineRun.objects.filter(pk=run.pk, mlflow_run_id="").update(
            mlflow_experiment_id=experiment, mlflow_run_id=parent
        )
        if not won:  # two stages started at once: the other one's parent is the run's
            client().delete_run(parent)
        run.refresh_from_db(fields=["mlflow_experiment_id", "mlflow_run_id"])
    return run.mlflow_run_id


def close_parent_run(run: PipelineRun, state: str) -> None:
    """The pipeline run is over: its parent run ends with the state it ended in."""
    if not enabled():
        return
    try:
        update_run(run.mlflow_run_id, {"hangar.state": state}, RUN_STATUS[state])
    except Exception as exc:  # MLflow down: the stages' own runs say how they ended
        log.warning("pipeline run %s: closing its MLflow run failed: %s", run.pk, exc)


def attempt_finished(job_id: int) -> None:
    """After an attempt's end is committed: the job's state and cost on its run, and the run's
    final status when the job is over. A state that is not final is read again once written:
    two updates of one job in flight at once (a requeue, then the next attempt's end) may read
    in one order and write in the other, and the last write must be what the job says now."""
    if not enabled():
        return
    written = None
    for _ in range(3):
        # One read: the job's state and run with its cost (JobCost, added in the finishing transaction).
        row = run_update_of.first(pk=job_id)
        if row is None or not row[1] or row == written:
            return
        state, run_id, cost = row
        try:
            tags = {"hangar.cost": f"{cost or 0:.4f}", "hangar.state": state}
            update_run(run_id, tags, RUN_STATUS[state] if state in FINAL_JOB_STATES else None)
        except Exception as exc:
            _record_error(job_id, exc)
            return
        if state in FINAL_JOB_STATES:  # a job's end is its last state
            return
        written = row


def update_run(run_id: str, tags: dict[str, str], status: str | None = None) -> None:
    """Set tags on a run and, given a status, set it: a final one ends the run, RUNNING (a later
    attempt) has it run again. On a database store one transaction that writes only those rows:
    MLflow's `log_batch` and `set_terminated` are a transaction each, and each reads the run
    with its tags, params and metrics first."""
    if (store := database_store()) is None:
        from mlflow.entities import RunTag

        client().log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])
        if status == "RUNNING":
            client().update_run(run_id, status=status)
        elif status is not None:
            client().set_terminated(run_id, status=status)
        return
    from mlflow.entities import LifecycleStage
    from mlflow.exceptions import MlflowException
    from mlflow.store.tracking.dbmodels.models import SqlRun, SqlTag
    from sqlalchemy import delete, insert, update

    runs, tags_table = SqlRun.__table__, SqlTag.__table__
    with store.engine.begin() as db:
        # The run's row first: whether it is still active, and its lock holds two updates of one
        # run in turn (their tags' delete and insert would race on PostgreSQL otherwise).
        if status is None:
            ended = {"status": runs.c.status}  # as it is: the row is written for its lock only
        else:  # a run that runs again has no end (yet)
            ended = {"status": status, "end_time": None if status == "RUNNING" else int(time.time() * 1000)}
        active = (runs.c.run_uuid == run_id) & (runs.c.lifecycle_stage == LifecycleStage.ACTIVE)
        if not db.execute(update(runs).where(active).values(**ended)).rowcount:
            raise MlflowException(f"MLflow run {run_id} was deleted (or never made): restore it to have it updated")
        # The tags replaced: two statements, not a read and a write per tag.
        db.execute(delete(tags_table).where(tags_table.c.run_uuid == run_id, tags_table.c.key.in_(list(tags))))
        db.execute(insert(tags_table), [{"run_uuid": run_id, "key": k, "value": v} for k, v in tags.items()])


def _record_error(job_id: int, exc: Exception) -> None:
    reason = f"MLflow at {settings.MLFLOW_TRACKING_URI} failed: {type(exc).__name__}: {str(exc)[:300]}"
    log.warning("job %s: %s", job_id, reason)
    Job.objects.filter(pk=job_id).update(tracking_error=reason)


def metrics(job: Job) -> dict:
    """The run's metric histories: {"available", "reason", "series": {key: [[step, value, ts_ms], ...]}}."""
    if not enabled():
        return {"available": False, "reason": "experiment tracking is off (HANGAR_MLFLOW=0)", "series": {}}
    if not job.mlflow_run_id:
        reason = job.tracking_error or "no MLflow run yet: it is created when the job starts"
        return {"available": False, "reason": reason, "series": {}}
    try:
        c = client()
        keys = sorted(c.get_run(job.mlflow_run_id).data.metrics)
        series = {}
        for key in keys:
            history = c.get_metric_history(job.mlflow_run_id, key)[-MAX_POINTS:]
            series[key] = [[m.step, m.value, m.timestamp] for m in sorted(history, key=lambda m: (m.step, m.timestamp))]
    except Exception as exc:
        reason = f"metrics unavailable: MLflow at {settings.MLFLOW_TRACKING_URI} failed: {type(exc).__name__}: {exc}"
        return {"available": False, "reason": reason[:500], "series": {}}
    return {"available": True, "reason": job.tracking_error, "series": series}


def latest_metrics(jobs: list[Job]) -> dict[int, dict[str, float]]:
    """Each job's metrics at their last step, for many jobs in one MLflow search per 100 runs
    (a sweep's ranking reads these, not every history); {} for jobs with no run or when MLflow fails."""
    runs = {job.mlflow_run_id: job.pk for job in jobs if job.mlflow_run_id}
    if not runs or not enabled():
        return {}
    experiments = sorted({job.mlflow_experiment_id for job in jobs if job.mlflow_run_id})
    found: dict[int, dict[str, float]] = {}
    ids = list(runs)
    try:
        for start in range(0, len(ids), 100):
            chunk = ", ".join(f"'{run_id}'" for run_id in ids[start : start + 100])  # hex ids Hangar stored
            for run in client().search_runs(
                experiments, filter_string=f"attributes.run_id IN ({chunk})", max_results=100
            ):
                found[runs[run.info.run_id]] = dict(run.data.metrics)
    except Exception as exc:
        log.warning("latest metrics of %d runs unavailable: %s", len(ids), exc)
        return {}
    return found


def metrics_figure(series: dict) -> dict:
    """One panel per metric (small multiples: a loss and an accuracy do not share a scale), each
    titled with its name, over a shared step axis; buttons switch every y axis linear/log."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(series)
    rows = max(1, len(names))
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=min(0.08, 0.3 / rows))
    for row, key in enumerate(names, start=1):
        points = series[key]
        line = go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers", name=key)
        fig.add_trace(line, row=row, col=1)
        fig.update_yaxes(title_text=key, row=row, col=1)
    fig.update_xaxes(title_text="step", row=rows, col=1)
    axes = [f"yaxis{'' if row == 1 else row}.type" for row in range(1, rows + 1)]
    scale = [{"label": kind, "method": "relayout", "args": [dict.fromkeys(axes, kind)]} for kind in ("linear", "log")]
    fig.update_layout(
        margin={"l": 60, "r": 10, "t": 30, "b": 40},
        height=max(320, 220 * rows),
        showlegend=True,
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
        updatemenus=[{"type": "buttons", "direction": "left", "x": 1, "xanchor": "right", "y": 1.08, "buttons": scale}],
    )
    return json.loads(fig.to_json())


def ui_url(job: Job) -> str:
    if not settings.HANGAR_MLFLOW_UI_URL or not job.mlflow_run_id:
        return ""
    return f"{settings.HANGAR_MLFLOW_UI_URL}/#/experiments/{job.mlflow_experiment_id}/runs/{job.mlflow_run_id}"


def tag_diagnosis(job_id: int, diagnosis: dict) -> None:
    """Put an attempt's diagnosis on the job's run, so it is seen where its metrics are."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None or not job.mlflow_run_id or not enabled():
        return
    try:
        tags = {
            "hangar.diagnosis.category": diagnosis["category"],
            "hangar.diagnosis": diagnosis["summary"][:4000],
            "hangar.diagnosis.hint": diagnosis["hint"][:4000],
        }
        c = client()  # first: it imports MLflow
        from mlflow.entities import RunTag

        c.log_batch(job.mlflow_run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    except Exception as exc:
        _record_error(job_id, exc)
