from datetime import timedelta

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from fleet import charts, evidence, signals
from fleet.gpus import FAULT_KINDS
from fleet.messages import node_wire
from fleet.models import HealthCheck, HealthEvent, Node, NodeState
from fleet.operator import OperatorError, change_state, inject_fault

PAGE_SIZE = 50
WINDOWS = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(days=1), "7d": timedelta(days=7)}


def fleet_nodes(params) -> tuple:
    """The filtered node list and the chosen filters: shared by the page and its websocket."""
    nodes = Node.objects.all()
    state, gpu = params.get("state", ""), params.get("gpu", "")
    if state:
        nodes = nodes.filter(state=state)
    if gpu:
        nodes = nodes.filter(gpu_model=gpu)
    return nodes, state, gpu


def fleet_page(params):
    nodes, state, gpu = fleet_nodes(params)
    page = Paginator(nodes.order_by("name"), PAGE_SIZE).get_page(params.get("page"))
    # One query for the page's GPUs, however many nodes it shows.
    page.object_list = list(page.object_list.prefetch_related("gpus"))
    return page, state, gpu


def fleet(request):
    page, state, gpu = fleet_page(request.GET)
    counts = dict(Node.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    context = {
        "page": page,
        "nodes": page.object_list,
        "state": state,
        "gpu": gpu,
        "states": [(s.value, s.label, counts.get(s.value, 0)) for s in NodeState],
        "total": sum(counts.values()),
        "gpu_models": Node.objects.order_by("gpu_model").values_list("gpu_model", flat=True).distinct(),
    }
    for node in page.object_list:
        node.cells = gpu_cells(node)
    return render(request, "fleet/fleet.html", context)


def gpu_cells(node: Node) -> list[dict]:
    """The per-GPU strip of a fleet row, formatted here: template filters over 8,000 cells cost too much."""
    cells = []
    for gpu in node_wire(node)["gpus"]:
        util, temp = _whole(gpu["util"]), _whole(gpu["temp"])
        title = f"GPU {gpu['index']}: {util}% · {temp}°C · {_whole(gpu['power'])} W · memory {_whole(gpu['mem_pct'])}%"
        if gpu["errors"]:
            title += " · " + ", ".join(gpu["errors"])
        cells.append({"util": util, "temp": temp, "title": title, "badge": gpu["errors"][0] if gpu["errors"] else ""})
    return cells


def _whole(value) -> str:
    return "–" if value is None else str(round(value))


def node_detail(request, name: str):
    node = get_object_or_404(Node, name=name)
    window_name = request.GET.get("window") if request.GET.get("window") in WINDOWS else "1h"
    since = timezone.now() - WINDOWS[window_name]
    context = {
        "node": node,
        "gpus": node.gpus.all(),
        "window": window_name,
        "windows": list(WINDOWS),
        "figure": charts.node_figure_json(node, since),
        # Another project's output and job ids are replaced for all but its members and staff.
        "events": evidence.redact(HealthEvent.objects.filter(node=node)[:50], request.user),
        **checks_of(node, request.user),
        "other_project": evidence.OTHER_PROJECT,
        "history": evidence.redact_history(node.state_history()[:50], request.user),
        "fault_kinds": FAULT_KINDS,
        "is_operator": request.user.is_staff,
        "attempts": [],
        # Hash, size and use only: which packages another project's jobs asked for is theirs.
        "cached_environments": node.cached_environments.all(),
    }
    for _, extra in signals.node_page.send(sender=Node, node=node, user=request.user):
        context.update(extra or {})  # the jobs app adds the attempts of the user's projects that ran here
    context["attempts"] = charts.with_throttle_seconds(node, context["attempts"])
    return render(request, "fleet/node_detail.html", context)


def checks_of(node: Node, user, limit: int = 60) -> dict:
    """The latest checks (as `user` may see them), failures first and shown; the routine passes folded away."""
    checks = evidence.redact(HealthCheck.objects.filter(node=node).select_related("attempt")[:limit], user)
    return {
        "checks": checks,
        "failed_checks": [c for c in checks if not c.passed],
        "passed_checks": [c for c in checks if c.passed],
    }


@require_POST
def node_action(request, name: str):
    if not request.user.is_staff:
        raise PermissionDenied("only fleet operators may change a node")
    node = get_object_or_404(Node, name=name)
    try:
        if request.POST.get("action") == "fault":
            gpu = request.POST.get("gpu")
            xid = request.POST.get("xid")
            fault = inject_fault(
                node,
                request.POST.get("kind", ""),
                request.user,
                int(gpu) if gpu not in (None, "") else None,
                int(xid) if xid not in (None, "") else None,
                float(request.POST.get("seconds") or 30),
            )
            messages.success(request, f"Fault {fault.kind} queued; the agent applies it at its next heartbeat.")
        else:
            outcome = change_state(
                node,
                request.POST.get("action", ""),
                request.user,
                request.POST.get("reason", ""),
                override=request.POST.get("override") == "on",
            )
            (messages.success if outcome.changed else messages.error)(request, outcome.message)
    except (OperatorError, ValueError) as exc:
        messages.error(request, str(exc))
    return redirect("fleet-node", name=node.name)
