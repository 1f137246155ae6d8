"""Checks run on a node before a job's command starts."""

from fleet.models import Node


def failed_checks(node: Node, gpu_indices: list[int], gpu_type: str) -> list[str]:
    """What is wrong with running on these GPUs of this node; empty when all is well."""
    failures = []
    known = set(node.gpus.values_list("index", flat=True))
    missing = sorted(set(gpu_indices) - known)
    if missing:
        failures.append(f"devices: GPU indices {missing} are not present on {node.name} (it has {sorted(known)})")
    if gpu_type and node.gpu_model != gpu_type:
        failures.append(f"device type: job asks for {gpu_type}, {node.name} has {node.gpu_model}")
    return failures
