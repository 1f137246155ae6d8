"""User regexes on PostgreSQL for tests/test_security_regex.py: a fresh database, one job
whose line is the catastrophic input, and the log API asked for the evil pattern and for one
RE2 accepts but PostgreSQL cannot compile. Prints JSON."""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.utils import timezone  # noqa: E402
from rest_framework.test import APIClient  # noqa: E402

from tests.factories import make_attempt, make_job, make_node, make_project, make_user  # noqa: E402

call_command("migrate", interactive=False, verbosity=0)
from jobs.models import LogLine  # noqa: E402
from portal.models import ApiToken  # noqa: E402

user = make_user("pg-regex")
job = make_job(make_project("pgre", manager=user), user)
attempt = make_attempt(job, make_node("node-pg"), "failed")
LogLine.objects.create(
    job=job, attempt=attempt, node=attempt.node, rank=0, seq=1, rank_seq=1, stream=1, severity=20,
    ts=timezone.now(), text="a" * 27 + "!a",
)  # fmt: skip
client = APIClient()
client.credentials(HTTP_AUTHORIZATION=f"Bearer {ApiToken.issue(user, 'pg')[1]}")
out = {}
for name, q in (("evil", "(a+)+$"), ("re2_only", r"\pL+")):
    began = time.monotonic()
    response = client.get(f"/api/v1/jobs/{job.pk}/logs/", {"q": q, "regex": "1"})
    body = response.json()
    out[name] = {
        "status": response.status_code,
        "seconds": round(time.monotonic() - began, 3),
        "field": (body.get("errors") or [{}])[0].get("field"),
        "lines": len(body.get("lines", [])),
    }
print(json.dumps(out))
