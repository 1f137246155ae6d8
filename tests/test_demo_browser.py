"""The demo's pages in a real browser; with HANGAR_SCREENSHOTS=docs they are the README's pictures
(docs/demo-*.png): a populated dashboard, fleet, cordoned node, queue, job with its live log, costs."""

import pytest

from tests.browsing import shoot
from tests.test_demo import running_demo

pytestmark = pytest.mark.e2e


def test_every_page_of_the_demo_has_life(browser):
    with running_demo() as demo:
        demo.wait_for_examples(180)  # loose: on a shared CI machine the demo may take longer
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(demo.url + "/login/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", demo.password)
        page.click("button.primary")
        page.wait_for_selector("text=Nodes")
        shoot(page, "demo-dashboard")

        page.goto(demo.url + "/fleet/")
        page.wait_for_selector("text=a100-4")
        page.wait_for_selector("text=uncorrectable ECC")  # the cordoned node says why
        shoot(page, "demo-fleet")

        page.goto(demo.url + "/fleet/nodes/a100-4/")
        page.wait_for_selector("text=uncorrectable ECC")
        page.wait_for_timeout(1000)  # the charts draw
        shoot(page, "demo-node")

        page.goto(demo.url + "/jobs/queue/")
        page.wait_for_selector("text=resnet-depth", timeout=30000)
        shoot(page, "demo-queue")

        (job_id,) = demo.query(
            "SELECT id FROM jobs_job WHERE state = 'running' AND nodes = 1 ORDER BY created_at LIMIT 1"
        )[0]
        page.goto(f"{demo.url}/jobs/{job_id}/")
        page.wait_for_selector("#log .line.stdout", timeout=30000)
        page.wait_for_timeout(2000)  # a few more lines arrive live
        page.locator("#log").scroll_into_view_if_needed()
        shoot(page, "demo-job")

        page.goto(demo.url + "/costs/")
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(1500)  # the charts draw
        shoot(page, "demo-costs")
        page.close()
        assert errors == []
