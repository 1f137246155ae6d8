"""The typed shape of the fleet websocket's messages, shared by the consumer and the page's script."""

from typing import Literal, TypedDict


class WireGpu(TypedDict):
    index: int
    util: float | None
    temp: float | None
    power: float | None
    mem_pct: float | None
    errors: list[str]


class WireNode(TypedDict):
    name: str
    state: str
    state_label: str
    state_colour: str
    state_reason: str
    heartbeat: str | None
    gpus: list[WireGpu]


class FleetMessage(TypedDict):
    """Server -> browser: the current state of the nodes on the page the browser shows."""

    type: Literal["nodes"]
    nodes: list[WireNode]
    counts: dict[str, int]


def node_wire(node) -> WireNode:
    """A node (with its GPUs prefetched) as the page and the websocket show it."""
    return {
        "name": node.name,
        "state": node.state,
        "state_label": node.get_state_display(),
        "state_colour": node.state_colour,
        "state_reason": node.state_reason if node.state != "ready" else "",
        "heartbeat": node.last_heartbeat_at.isoformat() if node.last_heartbeat_at else None,
        "gpus": [
            {
                "index": g.index,
                "util": g.utilization_pct,
                "temp": g.temperature_c,
                "power": g.power_w,
                "mem_pct": round(100 * g.memory_used_mb / g.memory_total_mb, 1)
                if g.memory_used_mb is not None and g.memory_total_mb
                else None,
                "errors": g.errors,
            }
            for g in node.gpus.all()
        ],
    }
