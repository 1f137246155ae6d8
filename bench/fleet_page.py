"""How does the fleet page hold up at 1,000 nodes x 8 GPUs?

Seeds an embedded Hangar (a temporary SQLite database) with 1,000 nodes of 8
GPUs, their latest telemetry and a day of history (every node at 10-minute
resolution, the measured node at the agents' full 5-second resolution), then
times, in process and server side (Django test client: view, queries and
template, no network):

- the fleet page (first page, a filtered page, the last page),
- a node page with its Plotly charts over 24 hours,
- the fleet websocket's database poll (one per tick per process, shared by all browsers),
- telemetry ingest: the agents' own write path (`Agent.store`: latest values
  and history rows) for many nodes in a row, as GPU samples per second.

    python bench/fleet_page.py [--quick] [--nodes N]

Last line: nodes=... gpus=... history_rows=... fleet_page_ms=... node_page_ms=... ws_poll_ms=...
ingest_samples_per_s=...
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPUS = 8


def seed(nodes: int, hours: float) -> int:
    from django.utils import timezone

    from fleet.models import GPU, Node, NodeState

    now = timezone.now()
    models = ["H100", "H200", "B300", "A100"]
    Node.objects.bulk_create(
        Node(
            name=f"gpu-{i:04d}",
            gpu_model=models[i % 4],
            gpu_count=GPUS,
            simulated=True,
            last_heartbeat_at=now,
            state=NodeState.CORDONED if i % 50 == 7 else NodeState.READY,
            state_reason="Xid 79 on GPU 3" if i % 50 == 7 else "",
        )
        for i in range(nodes)
    )
    ids = list(Node.objects.order_by("name").values_list("pk", flat=True))
    GPU.objects.bulk_create(
        (
            GPU(
                node_id=pk,
                index=g,
                uuid=f"GPU-{pk}-{g}",
                model="H100",
                memory_total_mb=81559,
                utilization_pct=(pk * 7 + g * 13) % 100,
                memory_used_mb=40000,
                temperature_c=40 + (pk + g) % 40,
                power_w=300,
                sm_clock_mhz=1980,
                ecc_uncorrected_volatile=1 if (pk + g) % 97 == 0 else 0,
                sampled_at=now,
            )
            for pk in ids
            for g in range(GPUS)
        ),
        batch_size=5000,
    )

    rows = 0
    for pk in ids:
        rows += insert_history(pk, now, hours, 5 if pk == ids[0] else 600)
    return rows


def insert_history(node_id: int, now, hours: float, step_s: int) -> int:
    """Raw inserts: Django model instances would make seeding, not the pages, the slow part."""
    from django.db import connection, transaction

    columns = "node_id, gpu_index, at, epoch_minute, period_s, utilization_pct, memory_used_mb, temperature_c, "
    columns += "power_w, sm_clock_mhz, thermal_throttle_s, power_throttle_s, ecc_uncorrected"
    sql = f"INSERT INTO fleet_telemetrysample ({columns}) VALUES ({', '.join(['%s'] * 13)})"
    params = []
    for k in range(int(hours * 3600 / step_s)):
        at = now - timedelta(seconds=k * step_s)
        stored = connection.ops.adapt_datetimefield_value(at)
        minute = int(at.timestamp() // 60)
        period = step_s if step_s > 5 else 0
        for g in range(GPUS):
            params.append((node_id, g, stored, minute, period, (k + g) % 100, 40000, 60 + k % 20, 500, 1980, 0, 0, 0))
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(sql, params)
    return len(params)


def timed(client, url: str, runs: int) -> float:
    client.get(url)  # warm: template compile, caches
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        response = client.get(url)
        timings.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (url, response.status_code)
    return statistics.median(timings)


def ws_poll_ms(runs: int) -> float:
    """The fleet websocket's database poll: once per tick per process, whatever the number of browsers."""
    from fleet.consumers import read_views_now

    views = {(), (("gpu", "H100"), ("state", "ready"))}
    read_views_now(views)
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        read_views_now(views)
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def ingest_rate(nodes: int) -> float:
    """GPU samples per second through the agents' write path, one node report after another."""
    from django.utils import timezone

    from agent.node import Agent
    from fleet.gpus import SimulatedProvider
    from fleet.models import Node

    agents = []
    for node in Node.objects.order_by("name")[:nodes]:
        agent = Agent(node.name, SimulatedProvider(node.name, "H100", GPUS), 5.0)
        agent.node = node
        agents.append(agent)
    samples = [a.provider.sample(set()) for a in agents]
    started = time.perf_counter()
    for agent, sample in zip(agents, samples, strict=True):
        agent.store(sample, timezone.now())
    return nodes * GPUS / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 nodes and 6 hours of history")
    parser.add_argument("--nodes", type=int, default=None)
    args = parser.parse_args()
    nodes = args.nodes or (100 if args.quick else 1000)
    hours = 6.0 if args.quick else 24.0

    os.environ["HANGAR_DATA_DIR"] = tempfile.mkdtemp(prefix="hangar-bench-fleet-")
    os.environ.pop("DATABASE_URL", None)  # always a throw-away embedded database
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client

    call_command("migrate", verbosity=0)
    started = time.perf_counter()
    rows = seed(nodes, hours)
    print(f"seeded {nodes} nodes x {GPUS} GPUs, {rows} history rows in {time.perf_counter() - started:.1f}s")

    client = Client()
    client.force_login(get_user_model().objects.create_superuser("bench", password="bench-password"))
    last = (nodes + 49) // 50
    fleet_ms = timed(client, "/fleet/", 5)
    filtered_ms = timed(client, "/fleet/?state=ready&gpu=H100", 5)
    last_ms = timed(client, f"/fleet/?page={last}", 5)
    node_ms = timed(client, "/fleet/nodes/gpu-0000/?window=24h", 3)
    api_ms = timed(client, "/api/v1/nodes/?limit=50", 5)
    poll_ms = ws_poll_ms(5)
    rate = ingest_rate(min(nodes, 200))
    print(f"fleet page: first {fleet_ms:.1f} ms, filtered {filtered_ms:.1f} ms, last page {last_ms:.1f} ms")
    print(f"fleet websocket: one poll for every browser of a process (first page + a filtered page): {poll_ms:.1f} ms")
    print(
        f"node page (24 h, {int(hours * 720 * GPUS)} samples of the node): {node_ms:.1f} ms; nodes API: {api_ms:.1f} ms"
    )
    print(
        f"nodes={nodes} gpus={nodes * GPUS} history_rows={rows} fleet_page_ms={fleet_ms:.1f} "
        f"fleet_filtered_ms={filtered_ms:.1f} node_page_ms={node_ms:.1f} nodes_api_ms={api_ms:.1f} "
        f"ws_poll_ms={poll_ms:.1f} ingest_samples_per_s={rate:.0f}"
    )


if __name__ == "__main__":
    main()
