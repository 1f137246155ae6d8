"""The fleet's node sizes as the submit check reads them, remembered for a few seconds.

Every submit compares its gpus_per_node and nodes with the registered nodes; nodes change
rarely, so one web process reads their sizes once per NODE_SIZES_SECONDS (its local-memory
cache), not once a submit. A node saved or deleted in this process counts at once; one
registered or resized by an agent within NODE_SIZES_SECONDS. Harmless either way: a job
refused by a stale size may be resubmitted a moment later, and one accepted for a node that
just went waits in the queue.
"""

from fleet.models import Node
from portal.remembered import forget_on_change, remembered

NODE_SIZES_SECONDS = 5.0
NODE_SIZES = "node-sizes"


def node_sizes() -> list[tuple[str, int]]:
    """(GPU model, GPU count) of every registered node."""
    return remembered(NODE_SIZES, read_node_sizes, NODE_SIZES_SECONDS)


def read_node_sizes() -> list[tuple[str, int]]:
    return list(Node.objects.order_by().values_list("gpu_model", "gpu_count"))


forget_on_change(NODE_SIZES, Node)
