"""What a new user meets on the pages: the favicon, cost pages with no rates, the log view's limit."""

from django.core.management import call_command
from django.test import Client

from jobs.models import GpuRate
from tests.factories import make_job


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_every_page_names_a_local_favicon_and_the_ico_path_answers(owner):
    page = signed_in(owner).get("/").content.decode()
    assert '<link rel="icon" href="/static/favicon.svg"' in page

    response = Client().get("/favicon.ico")
    assert response.status_code == 301 and response["Location"] == "/static/favicon.svg"


def test_cost_pages_say_when_a_gpu_type_of_the_fleet_has_no_rate(owner, project, node):
    for url in ("/costs/", "/costs/jobs/"):
        page = signed_in(owner).get(url).content.decode()
        assert "No GPU-hour rate is set for H100" in page and "/admin/jobs/gpurate/" in page

    GpuRate.objects.create(gpu_type="H100", effective_from="2026-01-01T00:00Z", per_gpu_hour="2.00")
    assert "No GPU-hour rate" not in signed_in(owner).get("/costs/").content.decode()


def test_a_first_start_seeds_example_rates_labelled_as_examples_once(owner, project, node):
    call_command("example_rates")
    call_command("example_rates")

    assert GpuRate.objects.filter(gpu_type="H100").count() == 1
    assert set(GpuRate.objects.values_list("note", flat=True)) == {GpuRate.EXAMPLE_NOTE}
    page = signed_in(owner).get("/costs/").content.decode()
    assert "No GPU-hour rate" not in page and "The rates for H100 are examples seeded at first start" in page


def test_the_job_page_says_its_log_view_keeps_only_the_latest_lines(owner, project, settings):
    settings.HANGAR_LOG_VIEW_LINES = 5000
    job = make_job(project, owner)

    page = signed_in(owner).get(f"/jobs/{job.pk}/").content.decode()

    assert 'data-max-lines="5000"' in page
    assert 'id="log-truncated" hidden' in page and "download the whole log" in page


def test_the_cost_card_is_a_partial_that_follows_the_job(owner, project, node):
    from jobs.models import AttemptState
    from tests.factories import make_attempt

    job = make_job(project, owner)
    page = signed_in(owner).get(f"/jobs/{job.pk}/").content.decode()
    assert f'hx-get="/jobs/{job.pk}/cost/" hx-trigger="job-state-changed from:body, every 10s"' in page
    assert "No attempt yet." in signed_in(owner).get(f"/jobs/{job.pk}/cost/").content.decode()

    make_attempt(job, node, AttemptState.RUNNING)
    card = signed_in(owner).get(f"/jobs/{job.pk}/cost/").content.decode()
    assert 'id="job-cost"' in card and "Cost so far" in card and "No attempt yet." not in card


def test_the_cost_card_is_scoped_to_the_callers_projects(owner, outsider, project, other_project):
    job = make_job(project, owner)
    assert signed_in(outsider).get(f"/jobs/{job.pk}/cost/").status_code == 404


def test_the_virtualenv_hangar_runs_in_is_a_named_host_environment(db):
    import sys

    from jobs.models import Environment

    call_command("venv_environment")

    environment = Environment.objects.get(name="hangar-venv")
    assert environment.kind == "host" and environment.path == sys.prefix and not environment.everywhere


def test_an_example_rate_replaced_by_a_real_one_is_no_longer_called_an_example(owner, project, node):
    call_command("example_rates")
    GpuRate.objects.create(gpu_type="H100", effective_from="2026-01-01T00:00Z", per_gpu_hour="3.10")

    assert "are examples seeded at first start" not in signed_in(owner).get("/costs/").content.decode()
