"""What an operator does to a node, the same from the UI, the API and `manage.py`:
cordon, drain, uncordon (with a burn-in after an automatic cordon), inject a fault.
Every state change carries a reason and lands in the audit trail."""

from dataclasses import dataclass

from fleet.gpus import FAULT_KINDS
from fleet.models import FaultInjection, Node, NodeState
from fleet.preflight import return_to_service

ACTIONS = ("cordon", "drain", "uncordon")


class OperatorError(ValueError):
    """A request an operator must change: the message says what to change. `field` names the input."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Outcome:
    changed: bool
    message: str


def change_state(node: Node, action: str, by, reason: str, override: bool = False) -> Outcome:
    reason = (reason or "").strip()
    if action not in ACTIONS:
        raise OperatorError("action", f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
    if not reason:
        raise OperatorError("reason", f"a reason is required to {action} a node; say why, it goes in the audit trail")
    if action == "uncordon":
        result = return_to_service(node, by, reason, override=override)
        return Outcome(result.done, result.message)
    if action == "cordon":
        changed = node.cordon(by, reason)
    else:
        if node.state == NodeState.OFFLINE:
            raise OperatorError("action", f"{node.name} is offline; cordon it instead of draining")
        changed = node.drain(by, reason)
    node.refresh_from_db()
    verb = {"cordon": "cordoned", "drain": "draining"}[action]
    return Outcome(changed, f"{node.name} {verb}" if changed else f"{node.name} is already {node.state}")


def inject_fault(
    node: Node, kind: str, by=None, gpu_index: int | None = None, xid: int | None = None, seconds: float = 30.0
) -> FaultInjection:
    """Queue a fault for a simulated node's agent, which applies it at its next heartbeat."""
    if not node.simulated:
        raise OperatorError("node", f"{node.name} has real GPUs; faults can only be injected on simulated nodes")
    if kind not in FAULT_KINDS:
        raise OperatorError("kind", f"unknown fault {kind!r}; use one of {', '.join(FAULT_KINDS)}")
    if gpu_index is not None and not 0 <= gpu_index < node.gpu_count:
        raise OperatorError("gpu", f"{node.name} has GPUs 0-{node.gpu_count - 1}; GPU {gpu_index} does not exist")
    if kind == "xid" and xid is None:
        xid = 79
    return FaultInjection.objects.create(
        node=node,
        kind=kind,
        gpu_index=gpu_index,
        xid=xid,
        seconds=seconds,
        created_by=by if by is not None and by.is_authenticated else None,
    )
