"""A small Python client for Hangar's REST API, with no Django in it: what the `hangar`
CLI is built on, and what an agent written in Python imports instead of shelling out.

    from hangar.client import Client
    hangar = Client.from_config()            # the URL and token `hangar login` saved
    job = hangar.submit({"project": "vision", "command": ["python", "train.py"]})
    job = hangar.wait(job["id"])             # until succeeded, failed or cancelled

Every refused request raises HangarError: `.body` is the server's error shape
(code, message, errors with the field and the fix) and `.code` the CLI's exit code
for it (5 refused, 6 unreachable or failed, 124 a wait that ran out).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx

EXIT_USAGE, EXIT_API, EXIT_UNREACHABLE, EXIT_WAIT_TIMEOUT = 2, 5, 6, 124
FINAL_STATES = ("succeeded", "failed", "cancelled")
DEFAULT_URL = "http://127.0.0.1:8000"


class HangarError(Exception):
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


class Client:
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
            raise HangarError(f"cannot reach Hangar at {self.url}: {exc}; check --url or HANGAR_URL", EXIT_UNREACHABLE)
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

    @classmethod
    def from_config(cls, url: str | None = None, token: str | None = None) -> Client:
        """The given URL and token, else HANGAR_URL / HANGAR_TOKEN, else what `hangar login` saved."""
        config = load_config()
        url = url or os.environ.get("HANGAR_URL") or config.get("url") or DEFAULT_URL
        token = token or os.environ.get("HANGAR_TOKEN") or config.get("token") or ""
        if not token:
            raise HangarError("not logged in: run `hangar login --url URL` (or set HANGAR_TOKEN)", EXIT_USAGE)
        return cls(url, token)

    def submit(self, spec: dict, idempotency_key: str | None = None) -> dict:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.post("/api/v1/jobs/", spec, headers=headers)

    def job(self, job_id: int) -> dict:
        return self.get(f"/api/v1/jobs/{job_id}/")

    def cancel(self, job_id: int, reason: str = "") -> dict:
        return self.post(f"/api/v1/jobs/{job_id}/cancel/", {"reason": reason} if reason else {})

    def wait(self, job_id: int, timeout: float | None = None) -> dict:
        """Poll the job until it ends (backing off to every 2 s); HangarError(124) after `timeout`."""
        deadline = time.monotonic() + timeout if timeout else None
        delay = 0.2
        while True:
            job = self.job(job_id)
            if job["state"] in FINAL_STATES:
                return job
            if deadline and time.monotonic() > deadline:
                raise HangarError(f"job {job_id} is still {job['state']} after {timeout:g}s", EXIT_WAIT_TIMEOUT)
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    def wait_all(self, job_ids: list[int], timeout: float | None = None) -> tuple[list[dict], bool]:
        """Poll the jobs until all ended or `timeout` ran out: (each job as it is now, in order; timed out)."""
        deadline = time.monotonic() + timeout if timeout else None
        delay, jobs = 0.2, {}
        while True:
            for job_id in job_ids:
                if jobs.get(job_id, {}).get("state") not in FINAL_STATES:
                    jobs[job_id] = self.job(job_id)
            if all(job["state"] in FINAL_STATES for job in jobs.values()):
                return [jobs[i] for i in job_ids], False
            if deadline and time.monotonic() > deadline:
                return [jobs[i] for i in job_ids], True
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    def result(self, job_id: int) -> dict:
        """The job's result document: outcome, diagnosis, metrics, objective, log tail, cost, times."""
        return self.get(f"/api/v1/jobs/{job_id}/result/")

    def create_sweep(self, body: dict) -> dict:
        """Create a sweep from a sweep file's content; the same content again returns the same sweep."""
        return self.post("/api/v1/sweeps/", body)

    def sweep(self, sweep_id: int) -> dict:
        """A sweep with its runs ranked by objective (best first) and its best run."""
        return self.get(f"/api/v1/sweeps/{sweep_id}/")

    # --- pipelines (jobs/pipelines.py) ---

    def submit_pipeline(self, document: dict, idempotency_key: str | None = None) -> dict:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.post("/api/v1/pipelines/", document, headers=headers)

    def pipeline(self, run_id: int) -> dict:
        return self.get(f"/api/v1/pipelines/{run_id}/")

    def cancel_pipeline(self, run_id: int, reason: str = "") -> dict:
        return self.post(f"/api/v1/pipelines/{run_id}/cancel/", {"reason": reason} if reason else {})

    def rerun_pipeline(self, run_id: int, from_stage: str = "") -> dict:
        return self.post(f"/api/v1/pipelines/{run_id}/rerun/", {"from_stage": from_stage} if from_stage else {})

    def wait_pipeline(self, run_id: int, timeout: float | None = None) -> dict:
        """Poll the pipeline run until every stage ended; HangarError(124) after `timeout`."""
        deadline = time.monotonic() + timeout if timeout else None
        delay = 0.2
        while (run := self.pipeline(run_id))["state"] == "running":
            if deadline and time.monotonic() > deadline:
                raise HangarError(f"pipeline run {run_id} is still running after {timeout:g}s", EXIT_WAIT_TIMEOUT)
            time.sleep(delay)
            delay = min(delay * 1.5, 2.0)
        return run

    # --- code snapshots (hangar/snapshots.py packs them) ---------------------------------

    def snapshot(self, project: str, sha256: str) -> dict | None:
        """The project's snapshot `sha256`, or None when it has none (then upload it)."""
        try:
            return self.get(f"/api/v1/projects/{project}/snapshots/{sha256}/")
        except HangarError as exc:
            if exc.body.get("code") == "not_found" and "has no snapshot" in exc.body.get("message", ""):
                return None
            raise

    def upload_snapshot(self, project: str, sha256: str, data: bytes) -> dict:
        return self.request(
            "PUT",
            f"/api/v1/projects/{project}/snapshots/{sha256}/",
            content=data,
            headers={"Content-Type": "application/gzip"},
            timeout=httpx.Timeout(30, write=600),
        )

    def ensure_snapshot(self, project: str, sha256: str, data: bytes) -> tuple[dict, bool]:
        """One round trip when the project has it already; else the upload too. (info, uploaded)."""
        found = self.snapshot(project, sha256)
        if found is not None:
            return found, False
        return self.upload_snapshot(project, sha256, data), True

    def code(self, job_id: int) -> bytes:
        """The tar.gz of job `job_id`'s code snapshot, its sha256 checked."""
        import hashlib

        try:
            response = self.http.get(f"/api/v1/jobs/{job_id}/code/", timeout=httpx.Timeout(30, read=600))
        except httpx.HTTPError as exc:
            raise HangarError(f"cannot reach Hangar at {self.url}: {exc}; check --url or HANGAR_URL", EXIT_UNREACHABLE)
        if response.status_code >= 400:
            raise api_error(response)
        expected = response.headers.get("X-Snapshot-Sha256", "")
        if expected and hashlib.sha256(response.content).hexdigest() != expected:
            raise HangarError(f"job {job_id}'s code arrived damaged (sha256 mismatch); try again", EXIT_UNREACHABLE)
        return response.content

    def priorities(self) -> list[dict]:
        """The server's priority classes, highest first."""
        return self.get("/api/v1/priorities/")

    def ws_url(self, path: str) -> str:
        return re.sub(r"^http", "ws", self.url) + path


def api_error(response: httpx.Response) -> HangarError:
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
    return HangarError(message, code, body if isinstance(body, dict) else None)
