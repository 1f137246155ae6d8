"""Job secrets: encrypted at rest, given to the job's process, never shown back."""

import importlib
import io
import sys

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone

from agent import runner as execution
from fleet.models import GPU
from jobs import scheduler, secret_env
from jobs.models import AttemptState, FailureClass, Job, LogLine
from tests.factories import make_job, make_node


def stored_secret_env(job: Job) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret_env FROM jobs_job WHERE id = %s", [job.pk])
        return str(cursor.fetchone()[0])


def test_the_database_column_holds_no_plaintext(project, owner):
    job = make_job(project, owner, secret_env={"WANDB_API_KEY": "s3cret-value"})

    stored = stored_secret_env(job)

    assert "s3cret-value" not in stored and "WANDB_API_KEY" in stored  # names stay readable, values do not
    assert Job.objects.get(pk=job.pk).secret_env == {"WANDB_API_KEY": "s3cret-value"}


def test_values_of_a_read_query_are_decrypted_too(project, owner):
    make_job(project, owner, secret_env={"KEY": "v"})
    assert list(Job.objects.values_list("secret_env", flat=True)) == [{"KEY": "v"}]


def ready_node():
    node = make_node("node-a", gpus=1)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    return node


def run_one(job: Job):
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)
    attempt.refresh_from_db()
    return attempt, list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))


def test_the_job_process_gets_the_secret_in_its_environment(transactional_db, project, owner):
    ready_node()
    check = "import os; print('secret ok' if os.environ['API_KEY'] == 's3cret-value' else 'secret wrong')"
    job = make_job(project, owner, command=[sys.executable, "-c", check], secret_env={"API_KEY": "s3cret-value"})

    attempt, lines = run_one(job)

    assert attempt.state == AttemptState.SUCCEEDED, attempt.reason
    assert "secret ok" in lines and not any("s3cret-value" in line for line in lines)


def test_a_secret_no_key_opens_fails_the_attempt_saying_so(transactional_db, project, owner, settings):
    ready_node()
    job = make_job(project, owner, command=[sys.executable, "-c", "print('ran')"], secret_env={"API_KEY": "x"})
    settings.SECRET_KEY = "another-secret-key-than-the-one-that-sealed-it"

    attempt, lines = run_one(job)

    assert attempt.state == AttemptState.FAILED
    assert "secret API_KEY cannot be decrypted" in attempt.reason and "ran" not in lines
    # This node's keys, not the job's fault (a second host without the shared key): infra, so it is rerun.
    assert attempt.failure_class == FailureClass.INFRA


def test_a_new_key_reads_old_secrets_and_reseal_lets_the_old_key_go(project, owner, settings):
    job = make_job(project, owner, secret_env={"KEY": "v"})  # sealed with the key derived from SECRET_KEY
    new_key = Fernet.generate_key().decode()
    settings.HANGAR_SECRETS_KEY = [new_key]
    assert Job.objects.get(pk=job.pk).secret_env == {"KEY": "v"}

    call_command("reseal_secrets", stdout=io.StringIO())
    settings.SECRET_KEY = "a-rotated-secret-key"  # the derived key no longer opens anything sealed before

    assert Job.objects.get(pk=job.pk).secret_env == {"KEY": "v"}
    settings.HANGAR_SECRETS_KEY = []
    assert Job.objects.get(pk=job.pk).secret_env == {"KEY": None}


def test_the_migration_encrypts_secrets_stored_in_plaintext(project, owner):
    job = make_job(project, owner)
    with connection.cursor() as cursor:  # a row as the previous migration left it
        cursor.execute("UPDATE jobs_job SET secret_env = %s WHERE id = %s", ['{"KEY": "plain-value"}', job.pk])
    before = MigrationLoader(connection).project_state(("jobs", "0005_cost_tracking")).apps
    migration = importlib.import_module("jobs.migrations.0006_secret_env_encrypted")

    migration.encrypt_existing(before, None)

    assert "plain-value" not in stored_secret_env(job)
    assert Job.objects.get(pk=job.pk).secret_env == {"KEY": "plain-value"}


@pytest.mark.parametrize("value", ["", "plain text", "gAAAAAbroken"])
def test_unseal_answers_none_for_what_is_not_a_token(value):
    assert secret_env.unseal(value) is None
