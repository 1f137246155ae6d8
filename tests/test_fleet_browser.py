"""The fleet pages in a real browser (Debian's Chromium via Playwright) against a real stack:
the fleet page follows a fault live, without reloading; the node page draws its Plotly charts.

With HANGAR_SCREENSHOTS=DIR set, the pages are saved as PNGs.
"""

import pytest

from tests.browsing import shoot
from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = {"HANGAR_HEARTBEAT_SECONDS": "0.5", "HANGAR_FLEET_POLL_SECONDS": "0.3", "HANGAR_SIM_GPUS": "8"}
    with LiveStack(env=env, data_dir=str(tmp_path_factory.mktemp("fleet-browser"))) as live:
        yield live


def test_the_fleet_page_follows_a_fault_live_and_the_node_page_charts(browser, stack):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # A script or connection the Content-Security-Policy refused shows up on the console.
    page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
    page.goto(stack.url + "/login/?next=/fleet/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.password)
    page.click("button.primary")
    page.wait_for_selector('tr[data-node="node-a"]')
    page.wait_for_selector("#fleet-live:has-text('live')")
    row = page.locator('tr[data-node="node-a"]')
    assert row.locator('[data-field="state"]').inner_text() == "Ready"
    assert row.locator(".cell").count() == 8

    stack.manage("inject_fault", "node-a", "ecc", "--gpu", "3")

    page.wait_for_function(
        """() => document.querySelector('tr[data-node="node-a"] [data-field="state"]').textContent === 'Cordoned'""",
        timeout=20000,
    )
    assert "ECC 1" in row.locator(".cell.bad").inner_text()
    assert "uncorrectable ECC" in row.locator('[data-field="reason"]').inner_text()
    page.wait_for_selector("[data-count=cordoned]:has-text('Cordoned 1')")
    assert page.locator("[data-count=ready]").is_hidden()
    shoot(page, "fleet")

    page.click("text=node-a")
    page.wait_for_selector("#telemetry .main-svg", timeout=20000)
    assert page.locator("text=Health events").is_visible()
    assert page.locator("text=node.auto_cordon").first.is_visible()
    shoot(page, "node")
    assert errors == []
