"""`hangar`: the command line for people and agents. It speaks only HTTP and
websockets to a Hangar server (httpx, websockets, the standard library; PyYAML
for YAML job files) and never touches the database.

Exit codes (`hangar wait`, `submit --wait`, `logs --follow` end with the job's):
0 succeeded · 1 the job failed (its command) · 2 bad usage · 3 cancelled ·
4 failed for infrastructure or timeout · 5 the API refused the request ·
6 the server could not be reached or failed · 124 `wait --timeout` ran out.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_CANCELLED, EXIT_INFRA = 0, 1, 2, 3, 4
EXIT_API, EXIT_UNREACHABLE, EXIT_WAIT_TIMEOUT = 5, 6, 124
FINAL_STATES = ("succeeded", "failed", "cancelled")
SEVERITIES = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
DEFAULT_URL = "http://127.0.0.1:8000"


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_API, body: dict | None = None):
        super().__init__(message)
        self.code = code
        self.body = body or {"code": "cli_error", "message": message, "errors": []}


# --- configuration ------------------------------------------------------------


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(os.environ.get("HANGAR_CONFIG", str(Path(base) / "hangar" / "config.json")))


def load_config() -> dict:
    path = config_path()
    return json.loads(path.read_text()) if path.exists() else {}


def save_config(config: dict) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)  # it holds a token
    path.write_text(json.dumps(config, indent=2))
    return path


# --- talking to the server ----------------------------------------------------


class Api:
    def __init__(self, url: str, token: str):
        self.url = url.rstrip("/")
        self.token = token
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=30
        )

    def request(self, method: str, path: str, **kwargs) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach Hangar at {self.url}: {exc}; check --url or HANGAR_URL", EXIT_UNREACHABLE)
        if response.status_code >= 400:
            raise api_error(response)
        if response.status_code == 204 or not response.content:
            return {}
        return response.json()

    def get(self, path: str, **params) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v not in (None, "")})

    def post(self, path: str, body: dict | None = None, headers: dict | None = None) -> Any:
        return self.request("POST", path, json=body or {}, headers=headers or {})

    def pages(self, path: str, limit: int | None = None, **params) -> list[dict]:
        """Every item of a paginated list, up to `limit`."""
        items: list[dict] = []
        offset = 0
        while True:
            page = self.get(path, limit=min(limit or 200, 200), offset=offset, **params)
            if isinstance(page, list):
                return page[:limit] if limit else page
            items.extend(page["results"])
            offset += len(page["results"])
            if not page.get("next") or not page["results"] or (limit and len(items) >= limit):
                return items[:limit] if limit else items

    def ws_url(self, path: str) -> str:
        return re.sub(r"^http", "ws", self.url) + path


def api_error(response: httpx.Response) -> CliError:
    try:
        body = response.json()
        message = body.get("message") or str(body)
    except ValueError:
        body, message = None, f"HTTP {response.status_code}: {response.text[:200]}"
    if response.status_code == 401:
        message += "; run `hangar login` with a valid token"
    if response.status_code == 429 and response.headers.get("Retry-After"):
        message += f" (Retry-After: {response.headers['Retry-After']}s)"
    code = EXIT_UNREACHABLE if response.status_code >= 500 else EXIT_API
    return CliError(message, code, body if isinstance(body, dict) else None)


def api_from(args) -> Api:
    config = load_config()
    url = args.url or os.environ.get("HANGAR_URL") or config.get("url") or DEFAULT_URL
    token = args.token or os.environ.get("HANGAR_TOKEN") or config.get("token") or ""
    if not token:
        raise CliError("not logged in: run `hangar login --url URL` (or set HANGAR_TOKEN)", EXIT_USAGE)
    return Api(url, token)


# --- output -------------------------------------------------------------------


def emit(args, data: Any, human: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else human)


def table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, str) and re.match(r"^\d{4}-\d\d-\d\dT", value):
        return value[:19].replace("T", " ")
    return str(value)


def outcome_code(job: dict) -> int:
    if job["state"] == "succeeded":
        return EXIT_OK
    if job["state"] == "cancelled":
        return EXIT_CANCELLED
    return EXIT_JOB_FAILED if job.get("failure_class") in ("user", "") else EXIT_INFRA


# --- commands -----------------------------------------------------------------


def cmd_login(args) -> int:
    config = load_config()
    url = (args.url or os.environ.get("HANGAR_URL") or config.get("url") or DEFAULT_URL).rstrip("/")
    token = (
        args.token or os.environ.get("HANGAR_TOKEN") or getpass.getpass(f"API token for {url} (from {url}/tokens/): ")
    )
    projects = Api(url, token.strip()).pages("/api/v1/projects/")
    config.update(url=url, token=token.strip())
    if args.project:
        config["project"] = args.project
    path = save_config(config)
    slugs = [p["slug"] for p in projects]
    emit(
        args,
        {"url": url, "projects": slugs, "config": str(path)},
        f"logged in to {url}; projects: {', '.join(slugs) or 'none'}",
    )
    return EXIT_OK


def load_job_file(path: str) -> dict:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    if path.endswith((".yaml", ".yml")) or not text.lstrip().startswith("{"):
        try:
            import yaml
        except ImportError:
            raise CliError("reading a YAML job file needs PyYAML: pip install PyYAML (or give JSON)", EXIT_USAGE)
        spec = yaml.safe_load(text)
    else:
        spec = json.loads(text)
    if not isinstance(spec, dict):
        raise CliError(f"{path}: a job file holds one mapping of job fields (project, command, ...)", EXIT_USAGE)
    return spec


def pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"{flag} {item!r}: write NAME=VALUE", EXIT_USAGE)
        out[key] = value
    return out


def job_spec(args) -> dict:
    spec = load_job_file(args.file) if args.file else {}
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    flags = {
        "name": args.name,
        "project": args.project or spec.get("project") or load_config().get("project"),
        "command": command or None,
        "gpus_per_node": args.gpus,
        "nodes": args.nodes,
        "gpu_type": args.gpu_type,
        "priority": args.priority,
        "max_runtime_seconds": args.max_runtime,
    }
    spec.update({k: v for k, v in flags.items() if v is not None})
    spec["env"] = {**spec.get("env", {}), **pairs(args.env, "--env")}
    spec["secret_env"] = {**spec.get("secret_env", {}), **pairs(args.secret_env, "--secret-env")}
    for volume in args.volume or []:
        name, _, mode = volume.partition(":")
        spec.setdefault("volumes", []).append({"name": name, "mode": mode or "ro"})
    for key in ("env", "secret_env"):
        if not spec[key]:
            del spec[key]
    if not spec.get("command"):
        raise CliError(
            "no command: give it after --, e.g. `hangar submit -- python train.py`, or in -f FILE", EXIT_USAGE
        )
    return spec


def cmd_submit(args) -> int:
    api = api_from(args)
    spec = job_spec(args)
    if not spec.get("project"):
        projects = [p["slug"] for p in api.pages("/api/v1/projects/") if p.get("role") != "viewer"]
        if len(projects) != 1:
            raise CliError(
                f"--project is required: you can submit to {', '.join(projects) or 'no project'}", EXIT_USAGE
            )
        spec["project"] = projects[0]
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
    job = api.post("/api/v1/jobs/", spec, headers=headers)
    if args.follow:
        if not args.json:
            print(f"job {job['id']} submitted to {job['project']}", file=sys.stderr)
        return follow(api, args, job["id"])
    if args.wait:
        job = wait_for(api, job["id"], args.timeout)
        emit(args, job, describe(job))
        return outcome_code(job)
    emit(args, job, f"job {job['id']} submitted to {job['project']} ({job['state']})")
    return EXIT_OK


def describe(job: dict) -> str:
    head = [
        f"job {job['id']} {job['name']} [{job['project']}] by {job['submitted_by']}",
        f"  state:    {job['state']}" + (f" ({job['state_reason']})" if job.get("state_reason") else ""),
        f"  command:  {' '.join(job['command'])}",
        f"  gpus:     {job['gpus_per_node']} x {job['nodes']} node(s) {job.get('gpu_type') or 'any type'}, "
        f"priority {job['priority']}",
    ]
    if job.get("exit_code") is not None:
        head.append(f"  exit:     {job['exit_code']} ({job.get('failure_class') or 'ok'})")
    head += describe_diagnosis(job)
    attempts = [{**a, "gpus": a["gpu_indices"]} for a in job.get("attempts", [])]
    columns = ["number", "state", "node", "gpus", "started_at", "finished_at", "exit_code", "failure_class"]
    return "\n".join(head) + ("\n\n" + table(attempts, columns) if attempts else "")


def describe_diagnosis(job: dict) -> list[str]:
    """Why the latest attempt failed, and a suspected hang, as `hangar status` prints them."""
    out = []
    if hang := job.get("hang_suspected"):
        out.append(f"  hang:     suspected: {hang['summary']}")
    if found := job.get("diagnosis"):
        rank = found.get("first_failing_rank")
        out.append(
            f"  why:      {found['category']}: {found['summary']}" + (f" (rank {rank})" if rank is not None else "")
        )
        out.append(f"  hint:     {found['hint']}")
        first = (found.get("evidence") or [{}])[0]
        if first.get("seq"):
            out.append(f"  evidence: seq {first['seq']} rank {first.get('rank', 0)}: {first.get('text', '')[:160]}")
    return out


def cmd_status(args) -> int:
    job = api_from(args).get(f"/api/v1/jobs/{args.job}/")
    emit(args, job, describe(job))
    return EXIT_OK


def cmd_list(args) -> int:
    params = {"state": args.state, "project": args.project, "submitted_by": "me" if args.mine else None}
    jobs = api_from(args).pages("/api/v1/jobs/", limit=args.limit, **params)
    columns = ["id", "name", "project", "submitted_by", "state", "gpus_per_node", "priority", "created_at"]
    emit(args, jobs, table(jobs, columns))
    return EXIT_OK


def cmd_cancel(args) -> int:
    job = api_from(args).post(f"/api/v1/jobs/{args.job}/cancel/", {"reason": args.reason or ""})
    emit(args, job, f"job {job['id']}: {job['state']}")
    return EXIT_OK


def cmd_resubmit(args) -> int:
    job = api_from(args).post(f"/api/v1/jobs/{args.job}/resubmit/")
    emit(args, job, f"job {args.job} resubmitted as job {job['id']} ({job['state']})")
    return EXIT_OK


def wait_for(api: Api, job_id: int, timeout: float | None) -> dict:
    deadline = time.monotonic() + timeout if timeout else None
    delay = 0.2
    while True:
        job = api.get(f"/api/v1/jobs/{job_id}/")
        if job["state"] in FINAL_STATES:
            return job
        if deadline and time.monotonic() > deadline:
            raise CliError(f"job {job_id} is still {job['state']} after {timeout:g}s", EXIT_WAIT_TIMEOUT)
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)


def cmd_wait(args) -> int:
    job = wait_for(api_from(args), args.job, args.timeout)
    emit(
        args,
        job,
        f"job {job['id']}: {job['state']}" + (f", exit {job['exit_code']}" if job["exit_code"] is not None else ""),
    )
    return outcome_code(job)


# --- logs -------------------------------------------------------------------------


def log_filters(args) -> dict:
    return {
        "node": args.node,
        "rank": args.rank,
        "severity": args.severity,
        "since": args.since,
        "until": args.until,
        **({"q": args.grep, "regex": "1"} if args.grep else {}),
    }


def keep(line: dict, args) -> bool:
    """The filters, applied here too, so they hold whatever the server already filtered."""
    if args.node and line.get("node") != args.node:
        return False
    if args.rank is not None and line.get("rank") != args.rank:
        return False
    if args.severity and SEVERITIES.index(line.get("severity", "INFO")) < SEVERITIES.index(args.severity):
        return False
    if args.since and line["ts"] < args.since:
        return False
    if args.until and line["ts"] > args.until:
        return False
    return not (args.grep and not re.search(args.grep, line["text"]))


def print_line(args, line: dict) -> None:
    if args.json:
        print(json.dumps(line), flush=True)
    else:
        where = f"{line.get('node') or '-'} r{line.get('rank', 0)}"
        print(f"{line['ts'][11:23]} {where} {line['severity']:<7} {line['text']}", flush=True)


def cmd_logs(args) -> int:
    api = api_from(args)
    if args.follow:
        return follow(api, args, args.job)
    cursor = {"attempt": 0, "seq": 0}
    while True:
        page = api.get(
            f"/api/v1/jobs/{args.job}/logs/",
            after_attempt=cursor["attempt"],
            after_seq=cursor["seq"],
            limit=1000,
            **log_filters(args),
        )
        for line in page["lines"]:
            if keep(line, args):
                print_line(args, line)
        # A page may be short, even empty, with more to come: a filter walking through lines that don't match.
        if not page["more"] or page["cursor"] == cursor:
            return EXIT_OK
        cursor = page["cursor"]


def follow(api: Api, args, job_id: int) -> int:
    """Stream the job's lines until it ends; reconnect from the last cursor if the socket drops."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    cursor = {"attempt": 0, "seq": 0}
    failures = 0
    while True:
        query = urlencode({"after_attempt": cursor["attempt"], "after_seq": cursor["seq"]})
        url = api.ws_url(f"/ws/jobs/{job_id}/logs/?{query}")
        try:
            with connect(url, additional_headers={"Authorization": f"Bearer {api.token}"}, open_timeout=15) as ws:
                failures = 0
                for raw in ws:
                    message = json.loads(raw)
                    if message["type"] == "lines":
                        for line in message["lines"]:
                            if keep(line, args):
                                print_line(args, line)
                        cursor = message["cursor"]
                    elif message["type"] == "state" and message["final"]:
                        job = api.get(f"/api/v1/jobs/{job_id}/")
                        if not args.json:
                            print(f"job {job_id} {job['state']}, exit {job['exit_code']}", file=sys.stderr)
                        return outcome_code(job)
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise CliError(
                f"the log stream of job {job_id} was refused (HTTP {status}); check the job id and your token"
            )
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            failures += 1
            if failures > 5:
                raise CliError(f"lost the log stream of job {job_id}: {exc}", EXIT_UNREACHABLE)
            time.sleep(min(0.5 * failures, 3))


# --- fleet, queue, cost -------------------------------------------------------------


def cmd_queue(args) -> int:
    api = api_from(args)
    body = api.get("/api/v1/queue/", project=args.project)
    waiting = table(
        body["waiting"], ["position", "id", "name", "project", "priority", "gpus_per_node", "reason", "estimated_start"]
    )
    running = table(body["running"], ["id", "name", "project", "priority", "state", "attempt", "started_at"])
    emit(args, body, f"waiting\n{waiting}\n\nrunning\n{running}")
    return EXIT_OK


def cmd_nodes(args) -> int:
    nodes = api_from(args).pages("/api/v1/nodes/")
    rows = [
        {**n, "gpus": f"{n['gpu_count']}x {n['gpu_model']}" + (" (sim)" if n.get("simulated") else "")} for n in nodes
    ]
    emit(args, nodes, table(rows, ["name", "state", "gpus", "last_heartbeat_at", "state_reason"]))
    return EXIT_OK


def cmd_node_action(args) -> int:
    node = api_from(args).post(f"/api/v1/nodes/{args.node}/{args.command_name}/", {"reason": args.reason})
    emit(args, node, f"node {args.node}: {node.get('state', args.command_name)}")
    return EXIT_OK


def cmd_cost(args) -> int:
    params = {"project": args.project, "by": args.by or "project", "date_from": args.since, "date_to": args.until}
    try:
        body = api_from(args).get("/api/v1/costs/summary/", **params)
    except CliError as exc:
        body = exc.body or {}
        if body.get("code") == "not_found" and "no API endpoint" in body.get("message", ""):
            raise CliError("this Hangar server has no cost API (/api/v1/costs/summary/); upgrade it to see costs")
        raise
    rows = body.get("rows", body) if isinstance(body, dict) else body
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        human = table(rows, list(rows[0]))
    else:
        human = json.dumps(body, indent=2)
    emit(args, body, human)
    return EXIT_OK


# --- the parser ------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=argparse.SUPPRESS, help="Hangar's address (default: saved by login, HANGAR_URL)"
    )
    common.add_argument("--token", default=argparse.SUPPRESS, help="API token (default: saved by login, HANGAR_TOKEN)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")

    top = argparse.ArgumentParser(prog="hangar", description=__doc__.split("\n\n")[0], parents=[common])
    sub = top.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = command("login", cmd_login, "save the server address and an API token")
    p.add_argument("--project", help="default project for submit")

    p = command("submit", cmd_submit, "submit a job: hangar submit [flags] -- COMMAND ARGS...")
    p.add_argument("-f", "--file", help="a YAML or JSON job file (- for stdin); flags override it")
    p.add_argument("-p", "--project")
    p.add_argument("-n", "--name")
    p.add_argument("-g", "--gpus", type=int, help="GPUs per node")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpu-type")
    p.add_argument("--priority", choices=["urgent", "high", "normal", "low", "scavenger"])
    p.add_argument("--max-runtime", type=int, metavar="SECONDS")
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE")
    p.add_argument("--secret-env", action="append", metavar="NAME=VALUE", help="never shown back")
    p.add_argument("-v", "--volume", action="append", metavar="NAME[:rw]")
    p.add_argument("--idempotency-key", help="a retried submit with the same key returns the first job")
    p.add_argument("--wait", action="store_true", help="wait for the end; exit with the job's outcome")
    p.add_argument("--follow", action="store_true", help="stream its logs until the end; exit with its outcome")
    p.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds")
    p.add_argument("command", nargs=argparse.REMAINDER)

    p = command("status", cmd_status, "a job's state and attempts")
    p.add_argument("job", type=int)

    p = command("list", cmd_list, "jobs of your projects, newest first")
    p.add_argument("--state")
    p.add_argument("-p", "--project")
    p.add_argument("--mine", action="store_true")
    p.add_argument("--limit", type=int, default=50)

    p = command("logs", cmd_logs, "a job's log lines")
    p.add_argument("job", type=int)
    p.add_argument("-f", "--follow", action="store_true", help="stream until the job ends; exit with its outcome")
    p.add_argument("--node")
    p.add_argument("--rank", type=int)
    p.add_argument("--severity", choices=SEVERITIES, type=str.upper, help="this severity and above")
    p.add_argument("--since", help="ISO time, e.g. 2026-01-31T12:00")
    p.add_argument("--until", help="ISO time")
    p.add_argument("--grep", help="a regular expression")

    p = command("wait", cmd_wait, "wait for a job to end; exit 0 succeeded, 1 failed, 3 cancelled, 4 infra")
    p.add_argument("job", type=int)
    p.add_argument("--timeout", type=float)

    p = command("cancel", cmd_cancel, "cancel a job")
    p.add_argument("job", type=int)
    p.add_argument("--reason")

    p = command("resubmit", cmd_resubmit, "submit a job again as a new job")
    p.add_argument("job", type=int)

    p = command("queue", cmd_queue, "queued jobs, their position and why they wait")
    p.add_argument("-p", "--project")

    command("nodes", cmd_nodes, "nodes, their GPUs and state")
    for action, help in [
        ("cordon", "take a node out of scheduling"),
        ("uncordon", "put a node back into scheduling"),
        ("drain", "cordon a node and let its running work finish"),
    ]:
        p = command(action, cmd_node_action, help)
        p.add_argument("node")
        p.add_argument("--reason", required=True)

    p = command("cost", cmd_cost, "spend by project, user, GPU type or day")
    p.add_argument("-p", "--project")
    p.add_argument("--by", choices=["project", "user", "gpu_type", "day"])
    p.add_argument("--since", help="first day, YYYY-MM-DD")
    p.add_argument("--until", help="last day, YYYY-MM-DD")
    return top


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # --help, or bad usage (argparse printed why)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    for name, default in (("url", None), ("token", None), ("json", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    try:
        return args.func(args)
    except CliError as exc:
        if args.json:
            print(json.dumps(exc.body))
        print(f"hangar: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
