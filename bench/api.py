"""How many job submissions per second does the API sustain, and at what latency?

Starts a whole Hangar (`manage.py up`) in a temporary data directory, cordons its
node (jobs stay queued: this measures the API, not the GPUs), then 50 concurrent
clients — each with its own API token and keep-alive connection — submit jobs
through `POST /api/v1/jobs/`. Every request is a full submit: token check,
validation, capacity check, insert, history row, scheduler wake-up. Three phases on
the same connections:

- warm-up, 1 s: every client connected and its token checked once;
- paced: together the clients ask --rate submits a second (default 200, the target),
  each on a fixed schedule; a submit's latency counts from when it was due, so a client
  held up by a slow answer reports its late sends too (no coordinated omission);
- flat out: each client submits again as soon as it has its answer, which gives the
  most the machine does (submissions_per_s) and its latency when saturated: with 50
  clients always waiting, the mean latency there is 50 / submissions_per_s by
  construction.

    python bench/api.py [--quick] [--clients N] [--seconds S] [--rate R] [--workers W] [--postgres]

Embedded default (SQLite) unless DATABASE_URL / CELERY_BROKER_URL / REDIS_URL are set;
--postgres makes a fresh database of its own on the local PostgreSQL and a Redis key
prefix of its own (HANGAR_TEST_POSTGRES_URL, HANGAR_TEST_REDIS_URL), dropped at the end.
A web process runs requests on a pool of threads (portal.sync_http) that share one
interpreter lock, so a process uses about one core: throughput scales with --workers
(web processes, default: the machine's cores), up to the cores PostgreSQL, the
scheduler and the clients leave free.
Last line: mode=... submissions_per_s=... p50_ms=... p99_ms=... (flat out) paced_rate=...
paced_per_s=... paced_p50_ms=... paced_p99_ms=... errors=... clients=... workers=...
web_cpu_ms=... client_cpu_ms=... machine_cpu_ms=... (CPU per submit flat out; the machine's
counts everything running on it, PostgreSQL and other people's work included).
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
    """The web server processes under `manage.py up` (portal.webserver)."""
    found = []
    for pid in descendants(root):
        try:
            if b"portal.webserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.extend(descendants(pid))
        except OSError:
            continue
    return found


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))] if ordered else float("nan")


class Client:
    """One client: a keep-alive HTTP/1.1 connection, one submit after the other.

    Plain asyncio streams rather than an HTTP library: the clients share the machine's
    cores with the server, and httpx cost ~3.7 ms of CPU per request here, which the
    server's figures would otherwise pay for."""

    def __init__(self, url: str, token: str, index: int):
        self.host, self.port, self.index, self.n = urlsplit(url).hostname, urlsplit(url).port, index, 0
        self.head = f"POST /api/v1/jobs/ HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
        self.head += "Content-Type: application/json\r\nContent-Length: "
        self.connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def submit(self) -> bool:
        """One job submitted (201), or False (an error; the connection is opened anew)."""
        self.n += 1
        body = json.dumps({"project": "default", "command": ["true"], "name": f"bench-{self.index}-{self.n}"})
        try:
            self.connection = self.connection or await asyncio.open_connection(self.host, self.port)
            status = await post(self.connection, f"{self.head}{len(body)}\r\n\r\n".encode() + body.encode())
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status, self.connection = None, None
        return status == 201

    def close(self) -> None:
        if self.connection:
            self.connection[1].close()


async def post(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> int:
    """Send one request, read its whole response (Content-Length framed); its status."""
    reader, writer = connection
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length")
    await reader.readexactly(length)
    return int(lines[0].split(" ", 2)[1])


async def flat_out(client: Client, until: float, latencies: list[float], errors: list[int]) -> None:
    """The next submit as soon as the last one is answered: the most the server does."""
    while time.monotonic() < until:
        started = time.monotonic()
        ok = await client.submit()
        (latencies if ok else errors).append((time.monotonic() - started) * 1000)


async def paced(client: Client, due: float, interval: float, until: float, latencies, errors) -> None:
    """One submit every `interval` seconds from `due` on. Latency counts from when a submit
    was due, not when it went: a client still waiting on a slow answer sends late, and that
    lateness is part of the latency (no coordinated omission)."""
    while due < until:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        ok = await client.submit()
        (latencies if ok else errors).append((time.monotonic() - due) * 1000)
        due += interval


async def load(clients: list[Client], seconds: float, rate: float = 0) -> tuple[list[float], int, float]:
    """Every client submitting for `seconds`: flat out, or together `rate` a second, their
    turns spread evenly. The latencies of the submits made, the errors, the time taken."""
    latencies: list[float] = []
    errors: list[float] = []
    started = time.monotonic()
    until = started + seconds
    if rate:
        interval = len(clients) / rate
        runs = [
            paced(c, started + i * interval / len(clients), interval, until, latencies, errors)
            for i, c in enumerate(clients)
        ]
    else:
        runs = [flat_out(c, until, latencies, errors) for c in clients]
    await asyncio.gather(*runs)
    return latencies, len(errors), time.monotonic() - started


async def phases(url: str, tokens: list[str], seconds: float, rate: float, measure) -> tuple:
    """Warm up, then paced at `rate` (unless 0), then flat out, on the same keep-alive
    connections; `measure()` is read around the flat-out phase."""
    clients = [Client(url, token, index) for index, token in enumerate(tokens)]
    try:
        await load(clients, 1.0)  # every client connected, its token checked once
        paced_run = await load(clients, seconds, rate) if rate else None
        before = measure()
        flat_run = await load(clients, seconds)
        used = [after - earlier for after, earlier in zip(measure(), before, strict=True)]
    finally:
        for client in clients:
            client.close()
    return paced_run, flat_run, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 s of load per phase instead of 30")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=None, help="length of each phase")
    parser.add_argument(
        "--rate", type=float, default=200, help="submits a second in the paced phase (0: no paced phase)"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="web processes (HANGAR_WEB_WORKERS)")
    parser.add_argument("--postgres", action="store_true", help="a fresh database on the local PostgreSQL")
    args = parser.parse_args()
    if args.postgres:
        from tests.livestack import ServicesDatabase

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
    from portal.models import ApiToken
    from tests.livestack import LiveStack

    mode = "embedded" if settings.EMBEDDED_DATABASE else "services"
    # The bench measures throughput, so the rate limit must not be what it measures.
    env = {"HANGAR_API_RATE_LIMIT": "1000000/min", "HANGAR_WEB_WORKERS": str(args.workers)}
    with LiveStack(data_dir=data_dir, env=env) as stack:
        for node in Node.objects.all():
            node.cordon(None, "bench/api.py: keep submitted jobs queued")
        admin = get_user_model().objects.get(username="admin")
        tokens = [ApiToken.issue(admin, f"bench-{i}")[1] for i in range(args.clients)]
        web = web_processes(stack.proc.pid)
        others = [pid for pid in descendants(stack.proc.pid) if pid not in web]

        def measure():
            return cpu_seconds(web), cpu_seconds(others), time.process_time(), machine_busy_seconds()

        paced_run, flat_run, used = asyncio.run(phases(stack.url, tokens, seconds, args.rate, measure))
        (latencies, errors, elapsed), (web_cpu, other_cpu, client_cpu, machine_cpu) = flat_run, used

    rate = len(latencies) / elapsed
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    figures = f"mode={mode} submissions_per_s={rate:.1f} p50_ms={p50:.1f} p99_ms={p99:.1f} "
    if paced_run:
        paced_latencies, paced_errors, paced_elapsed = paced_run
        paced_rate = len(paced_latencies) / paced_elapsed
        paced_p50, paced_p99 = percentile(paced_latencies, 50), percentile(paced_latencies, 99)
        print(
            f"paced: {args.clients} clients asking {args.rate:g} submits/s together for {paced_elapsed:.1f} s: "
            f"{paced_rate:.1f}/s done, p50 {paced_p50:.1f} ms, p99 {paced_p99:.1f} ms, {paced_errors} errors"
        )
        figures += f"paced_rate={args.rate:g} paced_per_s={paced_rate:.1f} paced_p50_ms={paced_p50:.1f} "
        figures += f"paced_p99_ms={paced_p99:.1f} "
        errors += paced_errors
    print(
        f"flat out: {len(latencies)} jobs submitted in {elapsed:.1f} s by {args.clients} clients, "
        f"{rate:.1f}/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )
    # CPU per submit holds under a loaded machine where the rate does not: the rate a
    # machine sustains is about (cores for the web server) / web_cpu_ms_per_submit.
    done = max(len(latencies), 1)
    print(
        f"CPU per submit, flat out: web server {web_cpu * 1000 / done:.1f} ms, scheduler and agent "
        f"{other_cpu * 1000 / done:.1f} ms, these clients {client_cpu * 1000 / done:.1f} ms, the whole machine "
        f"(with PostgreSQL, Redis, anything else running) {machine_cpu * 1000 / done:.1f} ms; "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{figures}errors={errors} clients={args.clients} seconds={seconds:g} workers={args.workers} "
        f"web_cpu_ms={web_cpu * 1000 / done:.1f} client_cpu_ms={client_cpu * 1000 / done:.1f} "
        f"machine_cpu_ms={machine_cpu * 1000 / done:.1f}"
    )


if __name__ == "__main__":
    main()
