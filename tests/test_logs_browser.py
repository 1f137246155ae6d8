"""The log viewer in a real browser (Debian's Chromium driven by Playwright) against a
real stack: a running job's lines arrive, and a severity and a node filter change the view.

The job runs on node-a; a second rank on node-b is written into the same attempt
by a LogWriter in another process (what a multi-node job's second agent does).
"""

import sys
import textwrap

import pytest

from tests.test_browser import stack  # noqa: F401 (the fixture)

pytestmark = pytest.mark.e2e

JOB = """
import time
for i in range(400):
    print(f"step {i} loss={1 / (i + 1):.4f}", flush=True)
    if i % 10 == 5:
        print(f"ERROR: step {i} had a NaN", flush=True)
    time.sleep(0.25)
"""

SECOND_RANK = """
import queue
from django.utils import timezone
from fleet.models import Node
from agent.output import LogWriter
from jobs.models import Attempt
node, _ = Node.objects.get_or_create(name="node-b", defaults=dict(gpu_model="H100", gpu_count=4, state="offline"))
attempt = Attempt.objects.get(job_id={job_id}, state="running")
lines = queue.Queue()
writer = LogWriter(attempt, lines, rank=1, node_id=node.pk)
writer.start()
for i in range(20):
    lines.put((1, timezone.now(), f"rank 1 step {{i}}\\n".encode(), False))
lines.put((2, timezone.now(), b"[ERROR] rank 1 lost its peer\\n", False))
writer.close()
"""


def rows(page) -> list[dict]:
    return page.eval_on_selector_all(
        "#log .line", "els => els.map(e => ({cls: e.className, title: e.title, text: e.innerText}))"
    )


def test_a_running_jobs_lines_arrive_and_filters_change_the_view(browser, stack):  # noqa: F811
    job = stack.submit([sys.executable, "-c", textwrap.dedent(JOB)], name="log-viewer")
    stack.wait_for(job["id"], ("running",))

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(stack.url + "/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.password)
    page.click("button.primary")
    page.goto(f"{stack.url}/jobs/{job['id']}/")

    page.wait_for_selector("#log .line.stdout")
    # The second rank writes while the page follows: its lines arrive live at the end
    # (rows are virtualised, so lines long scrolled past are not in the page).
    stack.manage("shell", "-c", SECOND_RANK.format(job_id=job["id"]))
    page.wait_for_selector("#log .line >> text=rank 1 step 19", timeout=20000)
    seen = page.locator("#log-count").inner_text()
    # A function, not an expression: Playwright evaluates an expression with eval, which the CSP refuses.
    page.wait_for_function(f"() => document.getElementById('log-count').innerText !== {seen!r}", timeout=10000)

    page.select_option("select[name=severity]", "ERROR")
    page.wait_for_function(
        "() => { const rows = [...document.querySelectorAll('#log .line')];"
        " return rows.length > 0 && rows.every(r => /sev-(error|critical)/.test(r.className)); }",
        timeout=10000,
    )
    assert any("had a NaN" in row["text"] for row in rows(page))
    assert any("lost its peer" in row["text"] for row in rows(page))

    page.select_option("select[name=node]", "node-b")
    page.wait_for_function(
        "() => { const rows = [...document.querySelectorAll('#log .line')];"
        " return rows.length === 1 && rows[0].title.includes('node-b'); }",
        timeout=10000,
    )
    (only,) = rows(page)
    assert "[ERROR] rank 1 lost its peer" in only["text"]

    assert page.locator("#log-first-error").is_visible()
    assert "/fleet/nodes/node-a/?at=" in page.locator("#log-first-error a.telemetry").get_attribute("href")
    page.close()
    stack.api("POST", f"/api/v1/jobs/{job['id']}/cancel/")
