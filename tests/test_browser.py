"""The portal in a real browser (Debian's Chromium driven by Playwright) against
a real stack: log in, submit a job from the form, watch its lines arrive.

With HANGAR_SCREENSHOTS=DIR set, the pages are also saved as PNGs (the README's
pictures come from here).
"""

import shlex
import sys

import pytest

from tests.browsing import shoot
from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LiveStack(data_dir=str(tmp_path_factory.mktemp("browser-stack"))) as live:
        yield live


def test_submit_from_the_form_and_watch_lines_arrive(browser, stack):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(stack.url + "/")
    assert "/login/" in page.url
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.password)
    page.click("button.primary")
    page.wait_for_selector("text=Nodes")
    assert page.locator(".badge.sim").first.is_visible()  # simulated GPUs are said to be simulated

    page.click("text=Submit a job")
    page.fill("input[name=name]", "browser-demo")
    program = "import time; [(print(f'step {i} loss={1/(i+1):.3f}'), time.sleep(0.3)) for i in range(8)]"
    page.fill("input[name=command]", f"{sys.executable} -c {shlex.quote(program)}")
    page.fill("input[name=gpus_per_node]", "2")
    page.click("button.primary")

    # The first line arrives while the job runs: placement, preflight and the viewer's read come
    # first, which on a loaded CI machine took more than Playwright's default 30 s once.
    page.wait_for_selector("#log .line.stdout", timeout=120000)
    page.wait_for_selector("text=step 7 loss=0.125", timeout=30000)
    page.wait_for_selector("#job-state[data-state=succeeded]", timeout=30000)
    texts = page.locator("#log .line.stdout").all_inner_texts()
    assert [t.split(" ", 1)[1] for t in texts] == [f"step {i} loss={1 / (i + 1):.3f}" for i in range(8)]
    shoot(page, "job")

    page.goto(stack.url + "/")
    page.wait_for_selector("text=browser-demo")
    shoot(page, "dashboard")
    page.close()


def test_queue_and_cost_pages_render_without_script_errors(browser, stack):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # A script or connection the Content-Security-Policy refused shows up on the console.
    page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
    page.goto(stack.url + "/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.password)
    page.click("button.primary")
    job = stack.submit([sys.executable, "-c", "print('for the cost page')"], name="costed")
    stack.wait_for(job["id"], ("succeeded",))

    page.goto(stack.url + "/jobs/queue/")
    assert page.locator("h1").inner_text() == "Queue"
    shoot(page, "queue")
    page.goto(stack.url + "/costs/")
    assert page.locator("h1").inner_text() == "Costs"
    page.wait_for_load_state("networkidle")
    assert page.locator("td", has_text="H100").count() >= 1  # the finished attempt counts under its GPU type
    shoot(page, "costs")
    assert errors == []
    page.close()


def test_form_errors_name_the_field(browser, stack):
    page = browser.new_page()
    page.goto(stack.url + "/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.password)
    page.click("button.primary")
    page.goto(stack.url + "/jobs/new/")
    page.fill("input[name=command]", "python train.py")
    page.fill("input[name=gpus_per_node]", "64")
    page.click("button.primary")
    error = page.locator(".field.has-error .error").first.inner_text()
    assert "gpus_per_node=64" in error and "ask for at most 4" in error
    page.close()
