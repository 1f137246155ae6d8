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

from hangar.client import (
    DEFAULT_URL,
    EXIT_API,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    EXIT_WAIT_TIMEOUT,
    Client,
    HangarError,
    load_config,
    save_config,
)

EXIT_OK, EXIT_JOB_FAILED, EXIT_CANCELLED, EXIT_INFRA = 0, 1, 3, 4
SEVERITIES = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
__all__ = ["EXIT_API", "EXIT_UNREACHABLE", "EXIT_USAGE", "EXIT_WAIT_TIMEOUT", "main"]


def api_from(args) -> Client:
    return Client.from_config(args.url, args.token)


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
    projects = Client(url, token.strip()).pages("/api/v1/projects/")
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
    """The job file's fields; any file that cannot be read or parsed is bad usage (exit 2), in one line."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise HangarError(f"cannot read job file {path}: {reason}", EXIT_USAGE)
    if path.endswith((".yaml", ".yml")) or not text.lstrip().startswith("{"):
        try:
            import yaml
        except ImportError:
            raise HangarError("reading a YAML job file needs PyYAML: pip install PyYAML (or give JSON)", EXIT_USAGE)
        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise HangarError(f"{path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}", EXIT_USAGE)
    else:
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise HangarError(f"{path} is not valid JSON: {exc}", EXIT_USAGE)
    if not isinstance(spec, dict):
        raise HangarError(f"{path}: a job file holds one mapping of job fields (project, command, ...)", EXIT_USAGE)
    return spec


def pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise HangarError(f"{flag} {item!r}: write NAME=VALUE", EXIT_USAGE)
        out[key] = value
    return out


def read_requirements(path: str) -> str:
    """A requirements.txt's text, sent as is: the server checks each line (and names the wrong one)."""
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise HangarError(f"cannot read requirements file {path}: {reason}", EXIT_USAGE)


def requirement_list(value) -> list[str]:
    """Requirements from a job file or --requirements (a list, or a requirements.txt's text) as a list."""
    if not value:
        return []
    return value.splitlines() if isinstance(value, str) else list(value)


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
        "environment": args.environment,
        "max_runtime_seconds": args.max_runtime,
    }
    spec.update({k: v for k, v in flags.items() if v is not None})
    spec["env"] = {**spec.get("env", {}), **pairs(args.env, "--env")}
    spec["secret_env"] = {**spec.get("secret_env", {}), **pairs(args.secret_env, "--secret-env")}
    for volume in args.volume or []:
        name, _, mode = volume.partition(":")
        spec.setdefault("volumes", []).append({"name": name, "mode": mode or "ro"})
    if args.requirements:
        spec["requirements"] = read_requirements(args.requirements)
    if args.pip:
        spec["requirements"] = requirement_list(spec.get("requirements")) + list(args.pip)
    if args.python:
        spec["python_version"] = args.python
    if args.ray:
        spec["launcher"] = "ray"
    for after in args.after or []:
        job, _, condition = after.partition(":")
        if not job.isdigit() or condition not in ("", "succeeded", "finished"):
            raise HangarError(f"--after {after!r}: write JOB or JOB:finished, e.g. --after 12:finished", EXIT_USAGE)
        spec.setdefault("depends_on", []).append({"job": int(job), "on": condition or "succeeded"})
    for key in ("env", "secret_env"):
        if not spec[key]:
            del spec[key]
    if not spec.get("command"):
        raise HangarError(
            "no command: give it after --, e.g. `hangar submit -- python train.py`, or in -f FILE", EXIT_USAGE
        )
    return spec


def cmd_submit(args) -> int:
    api = api_from(args)
    spec = job_spec(args)
    if not spec.get("project"):
        projects = [p["slug"] for p in api.pages("/api/v1/projects/") if p.get("role") != "viewer"]
        if len(projects) != 1:
            raise HangarError(
                f"--project is required: you can submit to {', '.join(projects) or 'no project'}", EXIT_USAGE
            )
        spec["project"] = projects[0]
    if args.code:
        spec["code"] = upload_code(api, args, spec["project"])
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
    job = api.post("/api/v1/jobs/", spec, headers=headers)
    if args.follow:
        if not args.json:
            print(f"job {job['id']} submitted to {job['project']}", file=sys.stderr)
        return follow(api, args, job["id"])
    if args.wait:
        job = api.wait(job["id"], args.timeout)
        emit(args, job, describe(job))
        return outcome_code(job)
    emit(args, job, f"job {job['id']} submitted to {job['project']} ({job['state']})")
    return EXIT_OK


def upload_code(api: Client, args, project: str) -> dict:
    """Pack --code DIR and make sure the project has it (asked first: an unchanged tree uploads
    nothing); the job spec's `code` field."""
    from hangar import snapshots

    limit = args.code_limit or os.environ.get("HANGAR_CODE_LIMIT_MB") or snapshots.DEFAULT_LIMIT_MB
    try:
        packed = snapshots.pack(args.code, float(limit))
    except ValueError:
        raise HangarError(f"HANGAR_CODE_LIMIT_MB={limit!r}: give a number of MB, e.g. 200", EXIT_USAGE)
    except snapshots.SnapshotError as exc:
        raise HangarError(str(exc), EXIT_USAGE)
    _, uploaded = api.ensure_snapshot(project, packed.sha256, packed.data)
    sent = f"uploaded {snapshots.mb(len(packed.data))}" if uploaded else "unchanged, nothing uploaded"
    print(
        f"code: {packed.files} files ({snapshots.mb(packed.size)}) from {args.code}, "
        f"snapshot {packed.sha256[:12]}: {sent}",
        file=sys.stderr,
    )
    for skipped in packed.skipped[:5]:
        print(f"code: left out {skipped}", file=sys.stderr)
    return packed.code_field()


def cmd_code(args) -> int:
    """Download a job's code snapshot: unpacked into -o DIR, or saved as is to -o FILE.tar.gz."""
    from hangar import snapshots

    data = api_from(args).code(args.job)
    out = Path(args.output or f"job-{args.job}-code")
    if out.name.endswith((".tar.gz", ".tgz")):
        out.write_bytes(data)
        human = f"job {args.job}'s code snapshot saved to {out} ({snapshots.mb(len(data))})"
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise HangarError(f"-o {out}: exists and is not an empty directory; give a new one", EXIT_USAGE)
        members = snapshots.unpack(data, out)
        human = f"job {args.job}'s code: {members} files in {out}"
    emit(args, {"job": args.job, "path": str(out), "bytes": len(data)}, human)
    return EXIT_OK


def describe(job: dict) -> str:
    head = [
        f"job {job['id']} {job['name']} [{job['project']}] by {job['submitted_by']}",
        f"  state:    {job['state']}" + (f" ({job['state_reason']})" if job.get("state_reason") else ""),
        f"  command:  {' '.join(job['command'])}",
        f"  gpus:     {job['gpus_per_node']} x {job['nodes']} node(s) {job.get('gpu_type') or 'any type'}, "
        f"priority {job['priority']}",
    ]
    if code := job.get("code"):
        head.append(f"  code:     snapshot {code['snapshot'][:12]}{git_text(code)}")
    if job.get("exit_code") is not None:
        head.append(f"  exit:     {job['exit_code']} ({job.get('failure_class') or 'ok'})")
    head += describe_environment(job)
    head += describe_diagnosis(job)
    attempts = [{**a, "placement": placement_text(a)} for a in job.get("attempts", [])]
    columns = ["number", "state", "placement", "started_at", "finished_at", "exit_code", "failure_class"]
    return "\n".join(head) + ("\n\n" + table(attempts, columns) if attempts else "")


def git_text(code: dict) -> str:
    if not code.get("commit"):
        return ""
    return f" (git {code.get('branch') or 'detached'} @ {code['commit'][:12]}{', dirty' if code.get('dirty') else ''})"


def describe_environment(job: dict) -> list[str]:
    """Its requirements, and the cached environment its latest attempt ran in (hash, how it was had)."""
    if not job.get("requirements"):
        return []
    python = f" (Python {job['python_version']})" if job.get("python_version") else ""
    lines = [f"  requires: {' '.join(job['requirements'])}{python}"]
    record = next((a["environment"] for a in reversed(job.get("attempts", [])) if a.get("environment")), None)
    if record:
        how = "cached" if record.get("cached") else f"built in {record.get('build_seconds')} s"
        lines.append(f"  env:      {record['hash'][:12]} {record['python']}, {how}: {' '.join(record['packages'])}")
    return lines


def placement_text(attempt: dict) -> str:
    """Every rank's node and GPUs: `gpu-a[0,1] gpu-b[0,1]` (rank order)."""
    ranks = attempt.get("placement") or [{"node": attempt["node"], "gpus": attempt["gpu_indices"]}]
    return " ".join(f"{r['node']}[{','.join(str(g) for g in r['gpus'])}]" for r in ranks)


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
    job = api_from(args).cancel(args.job, args.reason or "")  # a job that already ended: 409, exit 5
    emit(args, job, f"job {job['id']}: {job['state']}")
    return EXIT_OK


def cmd_resubmit(args) -> int:
    job = api_from(args).post(f"/api/v1/jobs/{args.job}/resubmit/")
    emit(args, job, f"job {args.job} resubmitted as job {job['id']} ({job['state']})")
    return EXIT_OK


def cmd_wait(args) -> int:
    job = api_from(args).wait(args.job, args.timeout)
    emit(
        args,
        job,
        f"job {job['id']}: {job['state']}" + (f", exit {job['exit_code']}" if job["exit_code"] is not None else ""),
    )
    return outcome_code(job)


# --- logs -------------------------------------------------------------------------


LOG_FILTER_ARGS = ("node", "rank", "severity", "since", "until", "grep", "after")


def log_filters(args) -> dict:
    """The filters as the server's query parameters. Only the server filters (the REST pages
    and the websocket alike), so `--grep`, `--since` and the rest mean exactly what the API's
    do: a case-insensitive regular expression, times compared as instants (zone offsets count)."""
    return {
        "node": args.node,  # (main gives commands without these flags, like submit --follow, None)
        "rank": args.rank,
        "severity": args.severity,
        "since": args.since,
        "until": args.until,
        **({"q": args.grep, "regex": "1"} if args.grep else {}),
    }


def parse_cursor(text: str | None) -> dict:
    """`--after ATTEMPT:SEQ` (what `logs --json` prints as each line's `cursor`)."""
    if not text:
        return {"attempt": 0, "seq": 0}
    attempt, sep, seq = text.partition(":")
    if not sep or not attempt.isdigit() or not seq.isdigit():
        raise HangarError(f"--after {text!r}: write ATTEMPT:SEQ, e.g. --after 41:1200 (a line's cursor)", EXIT_USAGE)
    return {"attempt": int(attempt), "seq": int(seq)}


def print_line(args, line: dict) -> None:
    if args.json:
        # Each line carries the cursor to resume after it: `hangar logs ID --after CURSOR`.
        print(json.dumps({**line, "cursor": f"{line['attempt']}:{line['seq']}"}), flush=True)
    else:
        where = f"{line.get('node') or '-'} r{line.get('rank', 0)}"
        print(f"{line['ts'][11:23]} {where} {line['severity']:<7} {line['text']}", flush=True)


def cmd_logs(args) -> int:
    api = api_from(args)
    cursor = parse_cursor(args.after)
    if args.follow:
        return follow(api, args, args.job, cursor)
    while True:
        page = api.get(
            f"/api/v1/jobs/{args.job}/logs/",
            after_attempt=cursor["attempt"],
            after_seq=cursor["seq"],
            limit=1000,
            **log_filters(args),
        )
        for line in page["lines"]:
            print_line(args, line)
        # A page may be short, even empty, with more to come: a filter walking through lines that don't match.
        if not page["more"] or page["cursor"] == cursor:
            return EXIT_OK
        cursor = page["cursor"]


# The server bounds every websocket message (512 KiB, README: Logs); the client accepts more.
WS_MAX_SIZE = 8 * 1024 * 1024
# Tries in a row that bring no new line or state before `follow` gives up (exit 6).
FOLLOW_TRIES = 6
WS_REFUSED = {
    4401: "the token is unknown, revoked, or its user deactivated; run `hangar login` with a valid token",
    4404: "no such job in your projects; check the job id",
    4429: "too many open log streams; close some and retry",
}


def follow(api: Client, args, job_id: int, cursor: dict | None = None) -> int:
    """Stream the job's lines until it ends; reconnect from the last cursor if the socket drops.
    A connection that brings nothing new counts as a failure: after FOLLOW_TRIES in a row on the
    same cursor it gives up, so a stream that keeps breaking ends instead of retrying for ever.
    A close the server means as a refusal (4401, 4404, 4429) ends it at once."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    cursor = dict(cursor or {"attempt": 0, "seq": 0})
    filters = {k: v for k, v in log_filters(args).items() if v not in (None, "")}
    failures = 0
    while True:
        query = urlencode({"after_attempt": cursor["attempt"], "after_seq": cursor["seq"], **filters})
        url = api.ws_url(f"/ws/jobs/{job_id}/logs/?{query}")
        try:
            with connect(
                url, additional_headers={"Authorization": f"Bearer {api.token}"}, open_timeout=15, max_size=WS_MAX_SIZE
            ) as ws:
                for raw in ws:
                    message = json.loads(raw)
                    if message["type"] == "lines":
                        for line in message["lines"]:
                            print_line(args, line)
                        if message["lines"] or message["cursor"] != cursor:
                            failures = 0  # progress: a later drop starts counting again
                        cursor = message["cursor"]
                    elif message["type"] == "error":
                        raise HangarError(f"{message.get('field')}: {message.get('message')}", EXIT_USAGE)
                    elif message["type"] == "state" and message["final"]:
                        job = api.get(f"/api/v1/jobs/{job_id}/")
                        if not args.json:
                            print(f"job {job_id} {job['state']}, exit {job['exit_code']}", file=sys.stderr)
                        return outcome_code(job)
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise HangarError(
                f"the log stream of job {job_id} was refused (HTTP {status}); check the job id and your token"
            )
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            closed = getattr(getattr(exc, "rcvd", None), "code", None)
            if closed in WS_REFUSED:  # the server's refusal (portal/wsauth.py): reconnecting cannot help
                raise HangarError(f"the log stream of job {job_id} was closed ({closed}): {WS_REFUSED[closed]}")
            failures += 1
            if failures >= FOLLOW_TRIES:
                where = f"{cursor['attempt']}:{cursor['seq']}"
                raise HangarError(
                    f"lost the log stream of job {job_id} {failures} times in a row at cursor {where}: {exc}; "
                    f"resume with `hangar logs {job_id} --follow --after {where}`",
                    EXIT_UNREACHABLE,
                )
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


def cmd_priorities(args) -> int:
    classes = api_from(args).priorities()
    emit(args, classes, table(classes, ["name", "rank", "may_preempt", "preemptible"]))
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
    except HangarError as exc:
        body = exc.body or {}
        if body.get("code") == "not_found" and "no API endpoint" in body.get("message", ""):
            raise HangarError("this Hangar server has no cost API (/api/v1/costs/summary/); upgrade it to see costs")
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
    p.add_argument("--priority", help="a priority class of the server (`hangar priorities` lists them)")
    p.add_argument("--environment", help="a named environment, e.g. hangar-venv (this install's virtualenv)")
    p.add_argument("--max-runtime", type=int, metavar="SECONDS")
    p.add_argument(
        "--requirements", metavar="FILE", help="a requirements.txt: the job runs in its cached environment (uv)"
    )
    p.add_argument("--pip", nargs="+", action="extend", metavar="PKG", help="packages of its cached environment")
    p.add_argument("--python", metavar="VERSION", help="with requirements: the Python version, e.g. 3.11")
    p.add_argument(
        "--ray",
        action="store_true",
        help="run on a Ray cluster of its nodes: rank 0 runs the command as the driver (needs --pip ray==...)",
    )
    p.add_argument("-e", "--env", action="append", metavar="NAME=VALUE")
    p.add_argument("--secret-env", action="append", metavar="NAME=VALUE", help="never shown back")
    p.add_argument("-v", "--volume", action="append", metavar="NAME[:rw]")
    p.add_argument("--idempotency-key", help="a retried submit with the same key returns the first job")
    p.add_argument(
        "--after",
        action="append",
        metavar="JOB[:finished]",
        help="start only after that job succeeded (or, with :finished, ended in any way); repeatable",
    )
    p.add_argument(
        "--code",
        metavar="DIR",
        help="run in a fresh copy of DIR (honours .gitignore and .hangarignore; uploaded only when changed)",
    )
    p.add_argument(
        "--code-limit",
        type=float,
        metavar="MB",
        help="refuse a --code DIR whose files exceed this (default: HANGAR_CODE_LIMIT_MB, else 100)",
    )
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
    p.add_argument("--grep", help="a regular expression, case-insensitive (as the API's q=...&regex=1)")
    p.add_argument("--after", metavar="ATTEMPT:SEQ", help="resume after this cursor (each --json line has its own)")

    p = command("wait", cmd_wait, "wait for a job to end; exit 0 succeeded, 1 failed, 3 cancelled, 4 infra")
    p.add_argument("job", type=int)
    p.add_argument("--timeout", type=float)

    p = command("cancel", cmd_cancel, "cancel a job")
    p.add_argument("job", type=int)
    p.add_argument("--reason")

    p = command("resubmit", cmd_resubmit, "submit a job again as a new job")
    p.add_argument("job", type=int)

    p = command("code", cmd_code, "download the code snapshot a job ran (submit --code)")
    p.add_argument("job", type=int)
    p.add_argument("-o", "--output", metavar="DIR", help="unpack into DIR (default job-ID-code), or save FILE.tar.gz")

    p = command("queue", cmd_queue, "queued jobs, their position and why they wait")
    p.add_argument("-p", "--project")

    command("priorities", cmd_priorities, "the server's priority classes, highest first")
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
    for name, default in (("url", None), ("token", None), ("json", False), *((n, None) for n in LOG_FILTER_ARGS)):
        if not hasattr(args, name):
            setattr(args, name, default)
    try:
        return args.func(args)
    except HangarError as exc:
        if args.json:
            print(json.dumps(exc.body))
        print(f"hangar: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
