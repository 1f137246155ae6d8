"""The pipeline run page in a real browser (Debian's Chromium, Playwright) on a real stack:
the DAG is drawn, the page follows the run to its end, and a click on a stage opens its job."""

import sys

import pytest

from tests.browsing import shoot
from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e


def test_the_run_page_draws_the_dag_follows_the_run_and_opens_a_stages_job(browser, tmp_path):
    with LiveStack(data_dir=str(tmp_path)) as stack:
        step = [sys.executable, "-c", "import time; time.sleep(1.5)"]
        body = {"project": "default", "name": "browser", "defaults": {"environment": "cuda"},
                "stages": {"prepare": {"command": step}, "train": {"needs": ["prepare"], "command": step}}}  # fmt: skip
        run = stack.api("POST", "/api/v1/pipelines/", json=body).json()
        train_job = run["stages"][1]["job"]

        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
        page.goto(stack.url + "/login/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", stack.password)
        page.click("button.primary")
        page.goto(stack.url + run["urls"]["page"])
        page.wait_for_selector("#pipeline-dag .scatterlayer .point")
        assert page.locator("#pipeline-dag .scatterlayer .point").count() == 2
        assert page.locator("#pipeline-dag .annotation-arrow-g").count() == 1  # prepare -> train

        page.wait_for_selector("#pipeline-status h2 .badge.green", timeout=60000)  # refreshed to the end
        page.wait_for_selector("#pipeline-dag .scatterlayer .point")  # drawn again after the refresh
        shoot(page, "pipeline")
        box = page.locator("#pipeline-dag .scatterlayer .point").nth(1).bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_url(f"**/jobs/{train_job}/")
        assert errors == []
        page.close()
