"""Pages carry a Content-Security-Policy that forbids inline script, and need none; CSV
exports cannot smuggle a formula into a spreadsheet."""

import csv
import io
import re
from pathlib import Path

import pytest
from django.test import Client

from jobs.views_costs import spreadsheet_safe
from tests.factories import make_job

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
INLINE_HANDLER = re.compile(r"\son[a-z]+\s*=|javascript:", re.I)


def policy_of(response) -> dict[str, str]:
    header = response["Content-Security-Policy"]
    return {part.split()[0]: part.strip() for part in header.split(";") if part.strip()}


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/login/", "/", "/fleet/", "/jobs/", "/costs/", "/api/docs/"])
def test_pages_forbid_inline_script(owner, url):
    client = Client()
    client.force_login(owner)
    response = client.get(url)
    assert response.status_code == 200
    policy = policy_of(response)
    assert policy["script-src"] == "script-src 'self'"
    assert "'none'" in policy["object-src"] and "'none'" in policy["frame-ancestors"]
    body = response.content.decode()
    assert not INLINE_SCRIPT.search(body), INLINE_SCRIPT.search(body).group(0)


@pytest.mark.django_db
def test_the_job_and_node_pages_forbid_inline_script(owner, project, node):
    job = make_job(project, owner)
    client = Client()
    client.force_login(owner)
    for url in (f"/jobs/{job.pk}/", f"/fleet/nodes/{node.name}/"):
        response = client.get(url)
        assert response.status_code == 200 and "script-src 'self'" in response["Content-Security-Policy"]
        assert not INLINE_SCRIPT.search(response.content.decode())


def test_no_template_has_inline_script_or_handlers():
    offenders = []
    for path in TEMPLATES.rglob("*.html"):
        text = path.read_text()
        if INLINE_SCRIPT.search(text) or INLINE_HANDLER.search(text):
            offenders.append(str(path.relative_to(TEMPLATES)))
    assert offenders == []


@pytest.mark.parametrize(
    "cell, safe",
    [
        ('=HYPERLINK("http://evil","x")', '\'=HYPERLINK("http://evil","x")'),
        ("+1+1", "'+1+1"),
        ("-2+3", "'-2+3"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("\tcmd", "'\tcmd"),
        ("\rcmd", "'\rcmd"),
        ("train", "train"),
        (-1.5, -1.5),
    ],
)
def test_cells_that_start_like_formulas_are_made_text(cell, safe):
    assert spreadsheet_safe(cell) == safe


@pytest.mark.django_db
def test_a_job_named_like_a_formula_is_exported_as_text(owner, project):
    make_job(project, owner, name='=HYPERLINK("http://evil.example","click")')
    client = Client()
    client.force_login(owner)
    body = b"".join(client.get("/costs/jobs.csv").streaming_content).decode()
    rows = list(csv.reader(io.StringIO(body)))
    names = [cell for row in rows[1:] for cell in row if "HYPERLINK" in cell]
    assert names and all(name.startswith("'=") for name in names)
