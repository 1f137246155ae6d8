"""Statements compiled once (portal/statements.py): run again with other values, they give
what the ORM gives, and they refuse what they cannot follow."""

import textwrap
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from fleet.models import HealthCheck
from fleet.preflight import CHECK_COLUMNS
from jobs.models import Attempt, Job
from portal import statements
from portal.statements import StatementError
from tests.factories import in_thread, make_attempt, make_job, make_node, make_project, make_user

RELATED = ("job", "node", "job__project", "job__submitted_by")


@statements.query
def attempt_with_job(pk: int):
    return Attempt.objects.select_related(*RELATED).filter(pk=pk)[:1]


@statements.query
def attempts_of(job_id: int, state: str):
    return Attempt.objects.filter(job_id=job_id).exclude(state=state).order_by("number").values_list("number", "state")


@statements.query
def started_since(since: datetime):
    return Attempt.objects.filter(started_at__gte=since).values("pk", "node__name").order_by("pk")


@statements.update
def end(pk: int, now: datetime, reason: str, exit_code: int | None, lease: datetime | None):
    return Attempt.objects.filter(pk=pk, state="running"), {
        "state": "failed",
        "finished_at": now,
        "lease_expires_at": lease,
        "reason": reason,
        "exit_code": exit_code,
    }


@statements.update
def taken(pk: int, state: str):
    """A JSON constant in an update (as jobs.models.attempt.first_rank_taken writes rank_status)."""
    return Attempt.objects.filter(pk=pk, state=state), {"state": "preflight", "rank_status": {"0": None, "1": [2, 3]}}


def json_constant_written(attempt) -> None:
    assert taken.update(pk=attempt.pk, state="scheduled") == 1
    assert taken.update(pk=attempt.pk, state="scheduled") == 0  # preflight now
    assert Attempt.objects.values_list("state", "rank_status").get(pk=attempt.pk) == (
        "preflight",
        {"0": None, "1": [2, 3]},
    )


@statements.query
def states_of(ids: list[int]):
    """A list of ids, in one SQL text for any number of them (the __any lookup)."""
    return Attempt.objects.filter(pk__any=ids).order_by("pk").values_list("pk", "state")


@statements.update
def all_lost(ids: list[int], reason: str):
    return Attempt.objects.filter(pk__any=ids, state="running"), {"state": "lost", "reason": reason}


def lists_of_ids_give_what_in_gives(attempts) -> None:
    ids = [a.pk for a in attempts]
    for some in ([], ids[:1], ids, [*ids, 10**9], (ids[0], ids[-1])):
        expected = list(Attempt.objects.filter(pk__in=some).order_by("pk").values_list("pk", "state"))
        assert states_of.rows(ids=some) == expected
        assert list(Attempt.objects.filter(pk__any=some).order_by("pk").values_list("pk", "state")) == expected
    running = Attempt.objects.filter(pk__in=ids, state="running").count()
    assert all_lost.update(ids=ids, reason="gone") == running > 0
    assert all_lost.update(ids=ids, reason="again") == 0
    assert all_lost.update(ids=[], reason="none") == 0
    assert set(Attempt.objects.filter(reason="gone").values_list("state", flat=True)) == {"lost"}


@statements.query
def locked(pk: int):
    return Attempt.objects.select_for_update().filter(pk=pk).values_list("state", flat=True)


@pytest.fixture
def two_jobs(db):
    user = make_user("ada")
    project = make_project("vision", admin=user)
    node = make_node("node-a")
    jobs = [make_job(project, user, name=f"job-{n}") for n in range(2)]
    earlier = timezone.now() - timedelta(hours=1)
    attempts = [
        make_attempt(jobs[0], node, "failed", started_at=earlier),
        make_attempt(jobs[0], node, "running", started_at=timezone.now()),
        make_attempt(jobs[1], node, "running", started_at=timezone.now()),
    ]
    return jobs, attempts


def fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in type(obj)._meta.concrete_fields}


def test_a_query_gives_what_the_orm_gives_for_every_value(two_jobs):
    jobs, attempts = two_jobs
    for attempt in attempts:
        mine = attempt_with_job.first(pk=attempt.pk)
        theirs = Attempt.objects.select_related(*RELATED).get(pk=attempt.pk)
        assert fields(mine) == fields(theirs)
        for related in ("job", "node"):
            assert fields(getattr(mine, related)) == fields(getattr(theirs, related))
        assert mine.job.project.slug == "vision" and mine.job.submitted_by.username == "ada"
        assert mine._state.db == "default" and not mine._state.adding
    assert attempt_with_job.first(pk=10**6) is None
    for job in jobs:
        for state in ("failed", "running"):
            expected = list(Attempt.objects.filter(job=job).exclude(state=state).order_by("number"))
            assert attempts_of.rows(job_id=job.pk, state=state) == [(a.number, a.state) for a in expected]


def test_a_datetime_value_is_adapted_as_django_adapts_it(two_jobs):
    _, attempts = two_jobs
    since = timezone.now() - timedelta(minutes=5)
    assert started_since.rows(since=since) == [{"pk": a.pk, "node__name": "node-a"} for a in attempts[1:]]
    assert [row["pk"] for row in started_since.rows(since=since - timedelta(hours=2))] == [a.pk for a in attempts]


def test_an_update_writes_its_values_and_counts_the_rows_it_matched(two_jobs):
    _, attempts = two_jobs
    now = timezone.now()
    lease = now + timedelta(minutes=2)
    assert end.update(pk=attempts[1].pk, now=now, reason="out of memory", exit_code=137, lease=lease) == 1
    assert end.update(pk=attempts[1].pk, now=now, reason="again", exit_code=1, lease=None) == 0  # no longer running
    assert end.update(pk=attempts[0].pk, now=now, reason="never", exit_code=1, lease=None) == 0
    row = Attempt.objects.values("state", "finished_at", "reason", "exit_code", "lease_expires_at").get(
        pk=attempts[1].pk
    )
    assert row == {
        "state": "failed",
        "finished_at": now,
        "reason": "out of memory",
        "exit_code": 137,
        "lease_expires_at": lease,
    }
    assert Attempt.objects.get(pk=attempts[2].pk).state == "running"
    Attempt.objects.filter(pk=attempts[2].pk).update(exit_code=5)
    assert end.update(pk=attempts[2].pk, now=now, reason="lost", exit_code=None, lease=None) == 1  # may be None
    assert Attempt.objects.values_list("exit_code", "reason").get(pk=attempts[2].pk) == (None, "lost")


def add_to_day(day, project, user, cost: Decimal, **other) -> int:
    from jobs.models.cost import day_cost_added

    values = {
        "day": day,
        "project_id": project.pk,
        "user_id": user.pk,
        "gpu_type": "H100",
        "label": "succeeded",
        "attempts": 1,
        "gpu_seconds": 2.5,
        "preflight_cost": Decimal("0.0001"),
        "running_cost": cost,
        "cost": cost + Decimal("0.0001"),
    }
    return day_cost_added.update(**{**values, **other})


def test_a_day_and_amounts_of_money_are_adapted_as_django_adapts_them(two_jobs):
    from jobs.models import CostDaily

    jobs, _ = two_jobs
    project, user = jobs[0].project, jobs[0].submitted_by
    today = timezone.now().date()
    CostDaily.objects.create(day=today, project=project, user=user, gpu_type="H100", label="succeeded")
    assert add_to_day(today, project, user, Decimal("1.2345")) == 1
    assert add_to_day(today, project, user, Decimal("0.0005")) == 1
    assert add_to_day(today - timedelta(days=1), project, user, Decimal("1")) == 0  # no row for that day
    row = CostDaily.objects.values("attempts", "gpu_seconds", "running_cost", "cost").get(day=today)
    assert row == {"attempts": 2, "gpu_seconds": 5.0, "running_cost": Decimal("1.2350"), "cost": Decimal("1.2352")}
    with pytest.raises(TypeError, match="day must be date"):
        add_to_day(timezone.now(), project, user, Decimal("1"))  # a datetime is not a day
    with pytest.raises(TypeError, match="running_cost must be Decimal"):
        add_to_day(today, project, user, Decimal("1"), running_cost=1.5)


def test_none_is_refused_in_a_condition_where_it_would_never_match(two_jobs):
    @statements.update
    def by_code(pk: int, exit_code: int | None):
        return Attempt.objects.filter(pk=pk, exit_code=exit_code), {"reason": "x"}

    with pytest.raises(StatementError, match="exit_code may be None, so only a new value"):
        by_code.update(pk=1, exit_code=None)

    with pytest.raises(StatementError, match="give pk one of the types"):

        @statements.query
        def maybe(pk: int | None):
            return Attempt.objects.filter(pk=pk)


@pytest.mark.django_db(transaction=True)
def test_a_statement_runs_on_the_connection_of_the_thread_that_runs_it(two_jobs):
    _, attempts = two_jobs
    attempt_with_job.first(pk=attempts[0].pk)  # compiled on this thread
    found: list = []
    in_thread(lambda: attempt_with_job.first(pk=attempts[2].pk).job.name, found).join()
    assert found == ["job-1"]


@pytest.mark.django_db(transaction=True)
def test_a_locking_read_outside_a_transaction_does_what_the_orm_does(two_jobs):
    """Refused where the database locks rows (PostgreSQL: the script below), run on SQLite."""
    _, attempts = two_jobs

    def outcome(read):
        try:
            return read()
        except TransactionManagementError:
            return "refused"

    orm = Attempt.objects.select_for_update().filter(pk=attempts[0].pk).values_list("state", flat=True)
    assert outcome(lambda: locked.rows(pk=attempts[0].pk)) == outcome(lambda: list(orm))
    with transaction.atomic():
        assert locked.rows(pk=attempts[0].pk) == ["failed"]


def test_values_of_the_wrong_type_or_name_are_refused(two_jobs):
    with pytest.raises(TypeError, match="must be int"):
        attempt_with_job.first(pk="1")
    with pytest.raises(TypeError, match="must be int"):
        attempt_with_job.first(pk=True)
    with pytest.raises(TypeError, match="takes pk"):
        attempt_with_job.first(id=1)
    with pytest.raises(TypeError, match="is an update"):
        end.rows(pk=1, now=timezone.now(), reason="", exit_code=0, lease=None)


def test_a_value_of_a_type_it_cannot_adapt_is_refused_when_declared():
    with pytest.raises(StatementError, match="give rank_status one of the types"):

        @statements.update
        def set_status(pk: int, rank_status: dict):
            return Attempt.objects.filter(pk=pk), {"rank_status": rank_status}


def test_sql_that_depends_on_the_values_is_refused_at_its_first_run(two_jobs):
    @statements.query
    def by_parity(pk: int):
        field = "pk" if pk < 1_900_050_000 else "number"  # the two compiles' stand-ins differ here
        return Attempt.objects.filter(**{field: pk})

    with pytest.raises(StatementError, match="depends on its values"):
        by_parity.rows(pk=1)


def test_a_value_the_sql_transforms_is_refused_at_its_first_run(two_jobs):
    @statements.query
    def reason_has(text: str):
        return Job.objects.filter(name__contains=text)  # the parameter is %text%

    with pytest.raises(StatementError, match="none of its values"):
        reason_has.rows(text="job")


def test_a_json_constant_is_written_as_the_orm_writes_it(two_jobs):
    _, attempts = two_jobs
    Attempt.objects.filter(pk=attempts[2].pk).update(state="scheduled")
    json_constant_written(attempts[2])


def test_json_made_from_a_value_is_refused_at_its_first_run(two_jobs):
    @statements.update
    def noted(pk: int, note: str):
        return Attempt.objects.filter(pk=pk), {"rank_status": {"note": note}}  # the value inside a constant

    with pytest.raises(StatementError, match="none of its values"):
        noted.update(pk=1, note="x")


def test_a_list_of_ids_gives_what_in_gives_with_one_sql_text(two_jobs):
    _, attempts = two_jobs
    lists_of_ids_give_what_in_gives(attempts)
    assert states_of.compiled["default"].sql.count("%s") == 1  # one parameter for the whole list


def test_a_list_is_taken_only_by_the_any_lookup(two_jobs):
    @statements.query
    def listed(ids: list[int]):
        return Attempt.objects.filter(pk__in=ids)  # one placeholder per id: the SQL depends on the list

    with pytest.raises(StatementError, match="none of its values"):
        listed.rows(ids=[1, 2])
    with pytest.raises(TypeError, match=r"must be list\[int\]"):
        states_of.rows(ids=[True])


def test_a_value_used_nowhere_is_refused_at_its_first_run(two_jobs):
    @statements.query
    def ignores(pk: int, state: str):
        return Attempt.objects.filter(pk=pk)

    with pytest.raises(StatementError, match="state not found"):
        ignores.rows(pk=1, state="running")


CHECK_ATTNAMES = [f"{c}_id" if c in ("node", "attempt") else c for c in CHECK_COLUMNS]


def checks(node, attempt, count: int = 2) -> list[tuple]:
    at = timezone.now()
    return [
        (node.pk, attempt and attempt.pk, "preflight", f"c{n}", n % 2 == 0, n + 0.25, f"saw {n}", at)
        for n in range(count)
    ]


def stored_checks(node) -> list[tuple]:
    return list(HealthCheck.objects.filter(node=node).order_by("id").values_list(*CHECK_ATTNAMES))


def insert_writes_what_bulk_create_writes(node, attempt) -> None:
    rows = checks(node, attempt) + checks(node, None)
    statements.insert(HealthCheck, CHECK_COLUMNS, rows)
    mine = stored_checks(node)
    HealthCheck.objects.filter(node=node).delete()
    HealthCheck.objects.bulk_create(HealthCheck(**dict(zip(CHECK_ATTNAMES, row, strict=True))) for row in rows)
    assert mine == stored_checks(node) == rows


def test_insert_writes_the_rows_bulk_create_writes(two_jobs):
    _, attempts = two_jobs
    insert_writes_what_bulk_create_writes(attempts[0].node, attempts[0])


def test_insert_splits_rows_beyond_the_databases_parameter_limit(two_jobs):
    _, attempts = two_jobs
    node = attempts[0].node
    rows = checks(node, None, count=1000)  # 8,000 values: SQLite takes 999 per statement
    statements.insert(HealthCheck, CHECK_COLUMNS, rows)
    assert stored_checks(node) == rows


@pytest.mark.django_db(transaction=True)
def test_rows_split_across_statements_are_stored_all_or_none(two_jobs):
    _, attempts = two_jobs
    node = attempts[0].node
    rows = checks(node, None, count=1000)
    rows[-1] = (*rows[-1][:3], None, *rows[-1][4:])  # no name: the last statement fails
    with pytest.raises(IntegrityError):
        statements.insert(HealthCheck, CHECK_COLUMNS, rows)
    assert stored_checks(node) == []


PG_SCRIPT = textwrap.dedent(
    """
    import django
    django.setup()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from django.db import connection
    assert connection.vendor == "postgresql", connection.vendor
    from tests import test_statements as t
    from tests.factories import make_attempt, make_job, make_node, make_project, make_user
    from django.utils import timezone
    user = make_user("ada"); project = make_project("vision", admin=user); node = make_node("node-a")
    job = make_job(project, user, name="job-0")
    a = make_attempt(job, node, "running", started_at=timezone.now())
    b = make_attempt(job, node, "failed", started_at=timezone.now())
    for attempt in (a, b):
        mine = t.attempt_with_job.first(pk=attempt.pk)
        theirs = t.Attempt.objects.select_related(*t.RELATED).get(pk=attempt.pk)
        assert t.fields(mine) == t.fields(theirs) and t.fields(mine.job) == t.fields(theirs.job)
    assert t.attempts_of.rows(job_id=job.pk, state="failed") == [(1, "running")]
    t.json_constant_written(make_attempt(make_job(project, user, name="job-1"), node, "scheduled"))  # a Jsonb
    t.lists_of_ids_give_what_in_gives([a, b])  # an array: = ANY(%s::bigint[])
    # The array is compared as the column's type (bigint), not as what psycopg makes of small
    # ids (smallint[]): only then can the planner hash it where it filters rows by it.
    sql = t.states_of.compiled["default"].sql
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (VERBOSE, COSTS OFF) " + sql, [[a.pk, b.pk]])
        plan = " ".join(row[0] for row in cursor.fetchall())
    assert "::bigint[]" in plan and "smallint" not in plan, plan
    t.Attempt.objects.filter(pk=a.pk).update(state="running")
    since = timezone.now() - timezone.timedelta(minutes=1)
    assert [r["pk"] for r in t.started_since.rows(since=since)] == [a.pk, b.pk]
    now = timezone.now()
    lease = now + timezone.timedelta(minutes=2)
    assert t.end.update(pk=a.pk, now=now, reason="oom", exit_code=137, lease=lease) == 1
    written = t.Attempt.objects.values_list("finished_at", "exit_code", "lease_expires_at").get(pk=a.pk)
    assert written == (now, 137, lease)
    t.Attempt.objects.filter(pk=a.pk).update(state="running")
    assert t.end.update(pk=a.pk, now=now, reason="lost", exit_code=None, lease=None) == 1
    assert t.Attempt.objects.values_list("exit_code", flat=True).get(pk=a.pk) is None
    try:
        t.locked.rows(pk=a.pk)
        raise AssertionError("a locking read outside a transaction was not refused")
    except t.TransactionManagementError:
        pass
    from django.db import transaction
    with transaction.atomic():
        assert t.locked.rows(pk=b.pk) == ["failed"]
    from decimal import Decimal
    from jobs.models import CostDaily
    today = timezone.now().date()
    CostDaily.objects.create(day=today, project=project, user=user, gpu_type="H100", label="succeeded")
    assert t.add_to_day(today, project, user, Decimal("1.2345")) == 1
    assert t.add_to_day(today - timezone.timedelta(days=1), project, user, Decimal("1")) == 0
    assert CostDaily.objects.values_list("attempts", "cost").get(day=today) == (1, Decimal("1.2346"))
    t.insert_writes_what_bulk_create_writes(node, a)
    # Prepared on this connection (portal/postgresql): the statements and the insert's few
    # rows, each with its values apart ($1...), and nothing else (the ORM's own queries, this read).
    import os, re
    from jobs.models.cost import day_cost_added
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = {row[0] for row in cursor.fetchall()}
    ran = [t.attempt_with_job, t.attempts_of, t.started_since, t.end, t.locked, day_cost_added, t.taken]
    ran += [t.states_of, t.all_lost]
    texts = set()
    for st in ran:
        numbers = iter(range(1, 1000))
        texts.add(re.sub("%s", lambda _: f"${next(numbers)}", st.compiled["default"].sql))
    inserts = {text for text in prepared if text.startswith('INSERT INTO "fleet_healthcheck"')}
    if os.environ.get("HANGAR_DB_PREPARED") == "0":
        assert prepared == set(), prepared
    else:
        assert len(inserts) == 1, prepared
        assert prepared - inserts == texts, (prepared ^ texts)
    print("statements on postgresql: ok")
    """
)


@pytest.mark.parametrize("prepared", ["1", "0"])
def test_statements_give_what_the_orm_gives_on_postgresql(prepared):
    """The suite's database is SQLite: the same statements on a PostgreSQL database of their own,
    prepared on their connection (HANGAR_DB_PREPARED, on by default) or not."""
    from tests.factories import on_postgresql

    run = on_postgresql(PG_SCRIPT, HANGAR_DB_PREPARED=prepared)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "statements on postgresql: ok" in run.stdout
