"""The agent's immediate re-check of a node's GPUs after a job's output reported a fault there.

It runs the preflight checks that a real fault fails (devices present, the
driver answering, no uncorrectable ECC or pending pages) plus the driver's own
pending Xid events, on what the node's provider reports now. Only the node's
own agent can re-check it; elsewhere there is nothing live to ask.
"""

from agent import running
from agent.preflight import live_context
from fleet import preflight
from fleet.models import Node

RECHECKS = ("devices", "driver", "ecc")


def recheck(node: Node, gpu_indices: list[int], attempt=None) -> tuple[bool, list[str]]:
    """(whether a re-check ran, what failed). Recorded as a `recheck` suite of health checks."""
    current = running.CURRENT
    if current is None or current.node is None or current.node.pk != node.pk:
        return False, []
    ctx = live_context(node, gpu_indices, "")
    results = [r for r in preflight.run_checks(ctx) if r.name in RECHECKS]
    xids = {i: s.xids for i, s in ctx.samples.items() if s.xids and (not gpu_indices or i in gpu_indices)}
    if xids:
        listed = ", ".join(f"GPU {i} Xid {'/'.join(map(str, x))}" for i, x in sorted(xids.items()))
        results.append(preflight.Result("xid_events", False, f"the driver reports {listed}"))
    preflight.record(node, results, "recheck", attempt)
    return True, [f"{r.name}: {r.evidence}" for r in results if not r.passed]
