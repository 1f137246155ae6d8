"""The diagnosis panel in a real browser (Debian's Chromium driven by Playwright) against a real
stack: a failed job's panel says why, and *Jump to evidence* scrolls the log to the line."""

import sys
import textwrap

import pytest

from tests.browsing import shoot
from tests.test_browser import stack  # noqa: F401 (the fixture)

pytestmark = pytest.mark.e2e

# The loss turns NaN early; the job goes on printing, then gives up: the evidence is far above the end.
JOB = """
import math
for i in range(600):
    loss = float("nan") if i >= 5 else 1 / (i + 1)
    print(f"step {i} loss {loss:.4f}", flush=True)
raise SystemExit(1)
"""


def test_the_panel_says_why_and_jumps_to_the_evidence(browser, stack):  # noqa: F811
    job = stack.submit([sys.executable, "-c", textwrap.dedent(JOB)], name="nan-loss")
    stack.wait_for(job["id"], ("failed",), timeout=60)

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(stack.url + "/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.password)
    page.click("button.primary")
    page.goto(f"{stack.url}/jobs/{job['id']}/")

    panel = page.wait_for_selector("#job-diagnosis", timeout=20000)
    assert "nan_loss" in panel.inner_text() and "learning rate" in panel.inner_text()
    seq = page.get_attribute("a.jump-evidence", "data-seq")
    page.wait_for_selector("#log .line >> text=step 599", timeout=20000)  # followed to the end
    assert not page.is_visible(f'#log .line[data-seq="{seq}"]')

    page.click("a.jump-evidence")

    page.wait_for_selector(f'#log .line[data-seq="{seq}"]', state="visible", timeout=10000)
    assert "step 5 loss nan" in page.inner_text(f'#log .line[data-seq="{seq}"]')
    shoot(page, "diagnosis")
