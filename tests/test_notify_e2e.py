"""Notifications through the whole stack (`manage.py up`: web, scheduler, notifier, agent):
a real job's end and a real cordon reach a local HTTP receiver, signed, through the broker."""

import json
import time

import pytest

from tests.livestack import LiveStack
from tests.test_notify import Receiver, verify

pytestmark = pytest.mark.e2e


def wait_for(hook: Receiver, count: int, stack: LiveStack, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(hook.got) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(hook.got) >= count, (len(hook.got), stack.output()[-3000:])


def test_a_job_end_and_a_cordon_reach_a_receiver_through_the_notifier():
    hook = Receiver(statuses=[503, 502])  # the job's end is delivered on the third try
    # The receiver is on 127.0.0.1: an operator's allowance, as webhooks go to public addresses only.
    env = {"HANGAR_WEBHOOK_BACKOFF_SECONDS": "0.2", "HANGAR_WEBHOOK_ALLOW_NETS": "127.0.0.1/32"}
    try:
        with LiveStack(env=env) as stack:
            made = stack.api(
                "POST",
                "/api/v1/subscriptions/",
                json={"project": "default", "events": ["job.failed", "node.cordoned"], "url": hook.url},
            )
            assert made.status_code == 201, made.text
            sub = made.json()
            job = stack.submit(["python3", "-c", "import sys; sys.exit(3)"], name="doomed")
            stack.wait_for(job["id"], ("failed",))
            wait_for(hook, 3, stack)
            payload = verify(*hook.got[2], sub["secret"])
            assert payload["event"] == "job.failed" and payload["job"]["id"] == job["id"]
            assert stack.api("POST", "/api/v1/nodes/node-a/cordon/", json={"reason": "fan noise"}).is_success
            wait_for(hook, 4, stack)
            cordon = verify(*hook.got[3], sub["secret"])
            assert cordon["event"] == "node.cordoned" and cordon["node"]["reason"] == "fan noise"
            log = stack.api("GET", f"/api/v1/subscriptions/{sub['id']}/deliveries/").json()
            by_event = {d["event"]: d for d in log}
            assert [t["status"] for t in by_event["job.failed"]["log"]] == [503, 502, 200]
            assert by_event["node.cordoned"]["state"] == "delivered"
            assert sub["secret"] not in json.dumps([body.decode() for _, body in hook.got])
    finally:
        hook.close()
