"""How many job submissions per second does the API sustain, and at what latency?

Starts a whole Hangar (`manage.py up`) in a temporary data directory, cordons its
node (jobs stay queued: this measures the API, not the GPUs), then 50 concurrent
clients — each with its own API token, keep-alive connections — submit jobs
through `POST /api/v1/jobs/` for a fixed time. Every request is a full submit:
token check, validation, capacity check, insert, history row, scheduler wake-up.

    python bench/api.py [--quick] [--clients N] [--seconds S] [--workers W] [--postgres]

Embedded default (SQLite) unless DATABASE_URL / CELERY_BROKER_URL / REDIS_URL are set;
--postgres makes a fresh database of its own on the local PostgreSQL and a Redis key
prefix of its own (HANGAR_TEST_POSTGRES_URL, HANGAR_TEST_REDIS_URL), dropped at the end.
Django's ASGI handler runs each request's synchronous code on a thread of its own, and
one web process's threads share one interpreter lock, so a process uses about one core:
throughput scales with --workers (uvicorn processes, default: the machine's cores), up to
the cores PostgreSQL, the scheduler and the clients leave free.
Last line: mode=... submissions_per_s=... p50_ms=... p99_ms=... errors=... clients=... workers=...
web_cpu_ms=... client_cpu_ms=... machine_cpu_ms=... (CPU per submit; the machine's counts everything
running on it, PostgreSQL and other people's work included).
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(parents.get(found[-1], []))
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU time every core of this machine has spent busy (not idle or waiting on disk), /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def web_processes(root: int) -> list[int]:
    """The uvicorn process under `manage.py up`, and its workers."""
    for pid in descendants(root):
        try:
            if b"uvicorn" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return descendants(pid)
        except OSError:
            continue
    return []


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def client(url: str, token: str, until: float, latencies: list[float], errors: list[int], index: int) -> None:
    """One client: a keep-alive HTTP/1.1 connection, one submit after the other.

    Plain asyncio streams rather than an HTTP library: the clients share the machine's
    cores with the server, and httpx cost ~3.7 ms of CPU per request here, which the
    server's figures would otherwise pay for."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    head = f"POST /api/v1/jobs/ HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
    head += "Content-Type: application/json\r\nContent-Length: "
    connection, n = None, 0
    while time.monotonic() < until:
        n += 1
        body = json.dumps({"project": "default", "command": ["true"], "name": f"bench-{index}-{n}"}).encode()
        started = time.perf_counter()
        try:
            connection = connection or await asyncio.open_connection(host, port)
            status = await post(connection, f"{head}{len(body)}\r\n\r\n".encode() + body)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status, connection = None, None
        if status == 201:
            latencies.append((time.perf_counter() - started) * 1000)
        else:
            errors.append(1)
    if connection:
        connection[1].close()


async def post(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> int:
    """Send one request, read its whole response (Content-Length framed); its status."""
    reader, writer = connection
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length")
    await reader.readexactly(length)
    return int(lines[0].split(" ", 2)[1])


async def load(url: str, tokens: list[str], seconds: float) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    errors: list[int] = []
    started = time.monotonic()
    until = started + seconds
    await asyncio.gather(*(client(url, t, until, latencies, errors, i) for i, t in enumerate(tokens)))
    return latencies, len(errors), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 s of load instead of 30")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="web processes (uvicorn --workers)")
    parser.add_argument("--postgres", action="store_true", help="a fresh database on the local PostgreSQL")
    args = parser.parse_args()
    if args.postgres:
        from portal.livestack import ServicesDatabase

        services = ServicesDatabase()
        if missing := services.available():
            sys.exit(missing)
        with services as env:
            os.environ.update(env)
            run(args)
    else:
        run(args)


def run(args) -> None:
    seconds = args.seconds or (5 if args.quick else 30)
    data_dir = tempfile.mkdtemp(prefix="hangar-bench-api-")
    os.environ["HANGAR_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from fleet.models import Node
    from portal.livestack import LiveStack
    from portal.models import ApiToken

    mode = "embedded" if settings.EMBEDDED_DATABASE else "services"
    # The bench measures throughput, so the rate limit must not be what it measures.
    env = {"HANGAR_API_RATE_LIMIT": "1000000/min", "HANGAR_WEB_WORKERS": str(args.workers)}
    with LiveStack(data_dir=data_dir, env=env) as stack:
        for node in Node.objects.all():
            node.cordon(None, "bench/api.py: keep submitted jobs queued")
        admin = get_user_model().objects.get(username="admin")
        tokens = [ApiToken.issue(admin, f"bench-{i}")[1] for i in range(args.clients)]
        asyncio.run(load(stack.url, tokens[:5], 1.0))  # warm up: imports, connections
        web = web_processes(stack.proc.pid)
        others = [pid for pid in descendants(stack.proc.pid) if pid not in web]
        web_cpu, other_cpu = cpu_seconds(web), cpu_seconds(others)
        client_cpu, machine_cpu = time.process_time(), machine_busy_seconds()
        latencies, errors, elapsed = asyncio.run(load(stack.url, tokens, seconds))
        web_cpu, other_cpu = cpu_seconds(web) - web_cpu, cpu_seconds(others) - other_cpu
        client_cpu, machine_cpu = time.process_time() - client_cpu, machine_busy_seconds() - machine_cpu

    rate = len(latencies) / elapsed
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(f"{len(latencies)} jobs submitted in {elapsed:.1f} s by {args.clients} clients, {errors} errors")
    # CPU per submit holds under a loaded machine where the rate does not: the rate a
    # machine sustains is about (cores for the web server) / web_cpu_ms_per_submit.
    done = max(len(latencies), 1)
    print(
        f"CPU per submit: web server {web_cpu * 1000 / done:.1f} ms, scheduler and agent "
        f"{other_cpu * 1000 / done:.1f} ms, these clients {client_cpu * 1000 / done:.1f} ms, the whole machine "
        f"(with PostgreSQL, Redis, anything else running) {machine_cpu * 1000 / done:.1f} ms; "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"mode={mode} submissions_per_s={rate:.1f} p50_ms={p50:.1f} p99_ms={p99:.1f} "
        f"errors={errors} clients={args.clients} seconds={seconds:g} workers={args.workers} "
        f"web_cpu_ms={web_cpu * 1000 / done:.1f} client_cpu_ms={client_cpu * 1000 / done:.1f} "
        f"machine_cpu_ms={machine_cpu * 1000 / done:.1f}"
    )


if __name__ == "__main__":
    main()
