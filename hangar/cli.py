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
    FINAL_STATES,
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
    if getattr(args, "torchrun", False):
        spec["launcher"] = "torchrun"
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
    packed = upload_code(api, args, spec["project"]) if args.code else None
    if packed is not None:
        spec["code"] = packed.code_field()
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
    job = api.post("/api/v1/jobs/", spec, headers=headers)
    if args.follow:
        if not args.json:
            print(f"job {job['id']} submitted to {job['project']}", file=sys.stderr)
        return follow(api, args, job["id"])
    if args.wait:
        job = api.wait(job["id"], args.timeout)
        emit(args, with_packing(job, packed), describe(job))
        return outcome_code(job)
    emit(args, with_packing(job, packed), f"job {job['id']} submitted to {job['project']} ({job['state']})")
    return EXIT_OK


def with_packing(job: dict, packed) -> dict:
    """The job as the API answered, and with --code what was packed and what left out (`code_packing`)."""
    return job if packed is None else {**job, "code_packing": packed.report()}


def upload_code(api: Client, args, project: str):
    """Pack --code DIR and make sure the project has it (asked first: an unchanged tree uploads
    nothing); what was packed (`code_field()` is the job spec's `code` field). Says on stderr
    what .gitignore and .hangarignore left out and what .hangarinclude brought back."""
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
    for line in packed.lines():
        print(f"code: {line}", file=sys.stderr)
    return packed


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
        try:
            members = snapshots.unpack(data, out)
        except snapshots.SnapshotError as exc:
            raise HangarError(f"job {args.job}: {exc}", EXIT_UNREACHABLE)  # what the server sent is unusable
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
    """Wait for every job (one deadline for all); with --json, print each one's result document
    (`hangar result`) on a line of its own, in the order given. The exit code is 124 when the
    timeout ran out (the documents still printed, with their current state), else the first
    non-zero outcome in that order, else 0."""
    api = api_from(args)
    jobs, timed_out = api.wait_all(args.job, args.timeout)
    for job in jobs:
        if args.json:
            print(json.dumps(api.result(job["id"]), default=str), flush=True)
        else:
            exit_text = f", exit {job['exit_code']}" if job.get("exit_code") is not None else ""
            print(f"job {job['id']}: {job['state']}{exit_text}")
    if timed_out:
        waiting = [str(j["id"]) for j in jobs if j["state"] not in FINAL_STATES]
        print(f"hangar: job {', '.join(waiting)} still not ended after {args.timeout:g}s", file=sys.stderr)
        return EXIT_WAIT_TIMEOUT
    return next((code for code in map(outcome_code, jobs) if code != EXIT_OK), EXIT_OK)


# --- results, metrics, compare (README: Agents) -------------------------------------


def describe_result(doc: dict) -> str:
    exit_text = f", exit {doc['exit_code']}" if doc.get("exit_code") is not None else ""
    why = f" ({doc['failure_class']})" if doc.get("failure_class") else ""
    lines = [f"job {doc['id']} {doc['name']} [{doc['project']}]: {doc['state']}{exit_text}{why}"]
    if objective := doc.get("objective"):
        value = objective["value"] if objective.get("found") else "not logged"
        lines.append(f"  objective: {objective['metric']} ({objective['mode']}) = {value}")
    if found := doc.get("diagnosis"):
        lines += [f"  why:       {found['category']}: {found['summary']}", f"  hint:      {found['hint']}"]
    times, cost = doc["times"], doc["cost"]
    lines.append(
        f"  time:      queued {times['queued_seconds']:.1f}s, preflight {times['preflight_seconds']:.1f}s, "
        f"running {times['running_seconds']:.1f}s; cost {cost['total']} ({cost['gpu_hours']} GPU-hours)"
    )
    rows = [{"metric": k, "last": v["last"]["value"], "best": v["best"]["value"], "step": v["last"]["step"]}
            for k, v in doc["metrics"].items()]  # fmt: skip
    if rows:
        lines += ["", table(rows, ["metric", "last", "best", "step"])]
    if first := doc.get("first_error"):
        lines += ["", f"first error (seq {first['seq']}, rank {first['rank']}): {first['text']}"]
    if doc["log_tail"]:
        lines += ["", "last lines:"] + [f"  {line['text']}" for line in doc["log_tail"]]
    return "\n".join(lines)


def cmd_result(args) -> int:
    doc = api_from(args).result(args.job)
    emit(args, doc, describe_result(doc))
    return EXIT_OK


def cmd_metrics(args) -> int:
    body = api_from(args).get(f"/api/v1/jobs/{args.job}/metrics/")
    body.pop("figure", None)  # the page's chart, not data
    if args.json:
        print(json.dumps(body, indent=2))
        return EXIT_OK
    if not body["series"]:
        print(f"job {args.job}: no metrics ({body.get('reason') or 'none logged'})")
    for name, points in body["series"].items():
        print(f"{name}: " + " ".join(f"{step}:{value:g}" for step, value, _ in points))
    return EXIT_OK


def cmd_compare(args) -> int:
    body = api_from(args).get("/api/v1/jobs/compare/", a=args.a, b=args.b)
    if args.json:
        print(json.dumps(body, indent=2))
        return EXIT_OK
    out = [f"job {args.a} vs job {args.b}" + (f": job {body['better']} is better" if body.get("better") else "")]
    out += [f"  {row['field']}: {row['a']} | {row['b']}" for row in body["spec_differences"]]
    rows = [{"metric": m["metric"], f"last {args.a}": (m["a"] or {}).get("last", {}).get("value"),
             f"last {args.b}": (m["b"] or {}).get("last", {}).get("value")} for m in body["metrics"]]  # fmt: skip
    if rows:
        out += ["", table(rows, list(rows[0]))]
    print("\n".join(out))
    return EXIT_OK


# --- sweeps (README: Agents) ---------------------------------------------------------


def cmd_sweep(args) -> int:
    """`hangar sweep -f sweep.yaml` creates (or, sent again, finds) a sweep; `status|best ID` read one."""
    api = api_from(args)
    if args.action is None:
        if not args.file:
            raise HangarError("give a sweep file: hangar sweep -f sweep.yaml (or: hangar sweep status ID)", EXIT_USAGE)
        body = load_job_file(args.file)
        if not body.get("project") and not (body.get("base") or {}).get("project"):
            body["project"] = args.project or load_config().get("project")
        sweep = api.create_sweep(body)
        emit(args, sweep, f"sweep {sweep['id']} {sweep['name']}: {sweep['variants']} variants ({sweep['state']})")
        return EXIT_OK
    if args.sweep_id is None:
        raise HangarError(f"hangar sweep {args.action} ID: give the sweep's id", EXIT_USAGE)
    if args.action == "cancel":
        sweep = api.post(f"/api/v1/sweeps/{args.sweep_id}/cancel/", {})
        emit(args, sweep, f"sweep {sweep['id']}: {sweep['cancelled_jobs']} jobs cancelled, no more variants")
        return EXIT_OK
    sweep = api.sweep(args.sweep_id)
    if args.action == "best":
        best = sweep["best"]
        emit(args, best, "no run has a value of the objective yet" if best is None else describe_run(sweep, best))
        return EXIT_OK if best is not None else EXIT_JOB_FAILED
    rows = [{**run, "params": json.dumps(run["params"])} for run in sweep["runs"]]
    human = f"sweep {sweep['id']} {sweep['name']}: {sweep['state']} {sweep['counts']}\n" + table(
        rows, ["index", "job", "state", "objective", "cost", "params"]
    )
    emit(args, sweep, human)
    return EXIT_OK


def describe_run(sweep: dict, run: dict) -> str:
    objective = sweep["objective"]
    return f"variant {run['index']} (job {run['job']}): {objective['metric']} = {run['objective']} {run['params']}"


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


def cmd_skill(args) -> int:
    """Print the skill file shipped in the package (hangar/skill.md): the experiment loop,
    condensed, for an AI coding agent to load. Needs no server and no login."""
    from importlib.resources import files

    text = files("hangar").joinpath("skill.md").read_text(encoding="utf-8")
    if args.json:
        print(json.dumps({"format": "markdown", "text": text}))
    else:
        print(text, end="")
    return EXIT_OK


# --- pipelines ----------------------------------------------------------------------


def load_pipeline_file(path: str) -> dict:
    """A pipeline file (YAML or JSON); a key given twice (two stages of one name) is refused,
    where YAML and JSON parsers would keep the last one silently."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise HangarError(f"cannot read pipeline file {path}: {getattr(exc, 'strerror', None) or exc}", EXIT_USAGE)
    try:
        document = json.loads(text, object_pairs_hook=unique_keys) if text.lstrip().startswith("{") else yaml_of(text)
    except ValueError as exc:
        raise HangarError(f"{path}: {exc}", EXIT_USAGE)
    if not isinstance(document, dict):
        raise HangarError(f"{path}: a pipeline file holds one mapping (project, params, stages)", EXIT_USAGE)
    return document


def unique_keys(pairs: list[tuple], where: str = "") -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"{key!r} is given twice{where}; give each stage (and each key) once")
        seen[key] = value
    return seen


def yaml_of(text: str):
    try:
        import yaml
    except ImportError:
        raise HangarError("reading a YAML pipeline file needs PyYAML: pip install PyYAML (or give JSON)", EXIT_USAGE)

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            pairs = [(self.construct_object(k, deep=deep), self.construct_object(v, deep=deep)) for k, v in node.value]
            return unique_keys(pairs, f" (line {node.start_mark.line + 1})")

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, UniqueKeys.construct_mapping)
    try:
        return yaml.load(text, Loader=UniqueKeys)  # a SafeLoader: no Python objects
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"not valid YAML{at}: {getattr(exc, 'problem', None) or exc}")


def describe_pipeline(run: dict) -> str:
    rows = [
        {**stage, "duration": f"{stage['duration_seconds']:.1f}s" if stage["duration_seconds"] is not None else None,
         "cost": f"{stage['cost']:.2f}" + (" (reused)" if stage["reused"] else ""), "needs": stage["needs"] or None}
        for stage in run["stages"]
    ]  # fmt: skip
    head = f"pipeline run {run['id']} {run['name']} ({run['project']}): {run['state']}, cost {run['cost']:.2f}"
    if run.get("rerun_of"):
        head += f", rerun of {run['rerun_of']}" + (f" from {run['from_stage']}" if run["from_stage"] else "")
    return "\n".join([head, table(rows, ["name", "job", "state", "needs", "duration", "cost", "state_reason"])])


def pipeline_outcome(run: dict) -> int:
    return {"succeeded": EXIT_OK, "cancelled": EXIT_CANCELLED}.get(run["state"], EXIT_JOB_FAILED)


def cmd_pipeline_run(args) -> int:
    document = load_pipeline_file(args.file)
    if args.project:
        document["project"] = args.project
    document.setdefault("project", load_config().get("project"))
    if args.param:
        document["params"] = {**(document.get("params") or {}), **pairs(args.param, "--param")}
    api = api_from(args)
    run = api.submit_pipeline(document, args.idempotency_key)
    for warning in run.get("warnings", []):
        print(f"hangar: warning: {warning}", file=sys.stderr)
    if not args.wait:
        emit(args, run, f"pipeline run {run['id']} submitted: {' -> '.join(s['name'] for s in run['stages'])}")
        return EXIT_OK
    run = api.wait_pipeline(run["id"], args.timeout)
    emit(args, run, describe_pipeline(run))
    return pipeline_outcome(run)


def cmd_pipeline_status(args) -> int:
    run = api_from(args).pipeline(args.run)
    emit(args, run, describe_pipeline(run))
    return EXIT_OK


def cmd_pipeline_list(args) -> int:
    runs = api_from(args).pages("/api/v1/pipelines/", limit=args.limit, project=args.project)
    emit(args, runs, table(runs, ["id", "name", "project", "submitted_by", "state", "cost", "created_at"]))
    return EXIT_OK


def cmd_pipeline_cancel(args) -> int:
    run = api_from(args).cancel_pipeline(args.run, args.reason or "")  # one that already ended: 409, exit 5
    emit(args, run, f"pipeline run {run['id']}: cancelled {', '.join(run['cancelled_stages']) or 'nothing'}")
    return EXIT_OK


def cmd_pipeline_rerun(args) -> int:
    run = api_from(args).rerun_pipeline(args.run, args.from_stage or "")
    how = f"from {args.from_stage}" if args.from_stage else "all stages"
    emit(args, run, f"pipeline run {args.run} run again ({how}) as pipeline run {run['id']}")
    return EXIT_OK


def cmd_env_list(args) -> int:
    environments = api_from(args).pages("/api/v1/environments/")
    rows = [{**e, "requirements": " ".join(e.get("requirements") or [])} for e in environments]
    emit(args, environments, table(rows, ["name", "kind", "python_version", "requirements", "description"]))
    return EXIT_OK


def cmd_env_rebuild(args) -> int:
    done = api_from(args).post(f"/api/v1/environments/{args.name}/rebuild/", {})
    emit(args, done, done.get("message", f"{args.name}: rebuild requested"))
    return EXIT_OK


def env_commands(sub, common) -> None:
    """`hangar env list|rebuild`."""
    group = sub.add_parser("env", parents=[common], help="environments: list them; drop a cached one on every node")
    commands = group.add_subparsers(dest="env_command", required=True, metavar="ENV_COMMAND")
    p = commands.add_parser("list", parents=[common], help="the environments jobs may name")
    p.set_defaults(func=cmd_env_list)
    help = "every node drops its cached copies of NAME (an environment, or a hash prefix from a node page)"
    p = commands.add_parser("rebuild", parents=[common], help=help, description=help)
    p.add_argument("name")
    p.set_defaults(func=cmd_env_rebuild)


def pipeline_commands(sub, common) -> None:
    """`hangar pipeline run|status|list|cancel|rerun`."""
    group = sub.add_parser("pipeline", parents=[common], help="run and follow pipelines (stages with needs)")
    commands = group.add_subparsers(dest="pipeline_command", required=True, metavar="PIPELINE_COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = commands.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = command("run", cmd_pipeline_run, "submit a pipeline file: hangar pipeline run -f pipeline.yaml")
    p.add_argument("-f", "--file", required=True, help="a YAML or JSON pipeline file (- for stdin)")
    p.add_argument("-p", "--project", help="overrides the file's project")
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="overrides one of the file's params")
    p.add_argument("--idempotency-key", help="a retried run with the same key returns the first pipeline run")
    p.add_argument("--wait", action="store_true", help="wait for every stage; exit 0 succeeded, 1 failed, 3 cancelled")
    p.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds (exit 124)")
    p = command("status", cmd_pipeline_status, "a pipeline run's stages, their jobs, states, durations and cost")
    p.add_argument("run", type=int)
    p = command("list", cmd_pipeline_list, "pipeline runs of your projects, newest first")
    p.add_argument("-p", "--project")
    p.add_argument("--limit", type=int, default=50)
    p = command("cancel", cmd_pipeline_cancel, "cancel a pipeline run's running and waiting stages")
    p.add_argument("run", type=int)
    p.add_argument("--reason")
    p = command("rerun", cmd_pipeline_rerun, "run a pipeline again, whole or --from STAGE (earlier stages reused)")
    p.add_argument("run", type=int)
    p.add_argument("--from", dest="from_stage", metavar="STAGE")


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
    p.add_argument(
        "--torchrun",
        action="store_true",
        help="start the command with torchrun: one process per GPU on each node, with RANK, LOCAL_RANK, WORLD_SIZE",
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

    p = command(
        "wait",
        cmd_wait,
        "wait for jobs to end; exit 0 succeeded, 1 failed, 3 cancelled, 4 infra or timeout, 124 --timeout ran out; "
        "--json prints each job's result document on its own line",
    )
    p.add_argument("job", type=int, nargs="+")
    p.add_argument("--timeout", type=float, help="give up after this many seconds (exit 124)")

    p = command("result", cmd_result, "a job's result: outcome, diagnosis, metrics, objective, log tail, cost, times")
    p.add_argument("job", type=int)

    p = command("metrics", cmd_metrics, "a job's metric histories (MLflow): step, value, time in ms")
    p.add_argument("job", type=int)

    p = command("compare", cmd_compare, "two jobs side by side: spec differences, metrics, objective")
    p.add_argument("a", type=int)
    p.add_argument("b", type=int)

    p = command(
        "sweep",
        cmd_sweep,
        "sweeps: `sweep -f sweep.yaml` creates one (the same file again creates nothing); "
        "`sweep status ID`, `sweep best ID` read one (best exits 1 while no run has a value); `sweep cancel ID`",
    )
    p.add_argument("action", nargs="?", choices=["status", "best", "cancel"])
    p.add_argument("sweep_id", nargs="?", type=int)
    p.add_argument("-f", "--file", help="a YAML or JSON sweep file (- for stdin)")
    p.add_argument("-p", "--project", help="when the file names none")

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

    pipeline_commands(sub, common)
    env_commands(sub, common)

    command("skill", cmd_skill, "print the skill file: the experiment loop for AI agents (commands, exit codes, JSON)")

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
