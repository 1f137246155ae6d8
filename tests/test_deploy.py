"""`manage.py check --deploy` passes with the production settings the README documents."""

import os
import subprocess
import sys

from tests.livestack import BASE_DIR


def test_check_deploy_passes_with_production_settings(tmp_path):
    env = {
        **os.environ,
        "HANGAR_DATA_DIR": str(tmp_path),
        "HANGAR_SECRET_KEY": "x" * 20 + "a-long-random-production-secret-key-0123456789",
        "HANGAR_DEBUG": "0",
        "HANGAR_HTTPS": "1",
        "HANGAR_ALLOWED_HOSTS": "hangar.example.com",
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout


def test_create_token_can_limit_the_token(roles):
    from django.core.management import call_command

    from portal.models import ApiToken

    call_command(
        "create_token", "lab-member", "--name", "ci", "--project", "lab", "--read-only", stdout=open(os.devnull, "w")
    )

    token = ApiToken.objects.get(name="ci")
    assert token.project == roles["lab"] and token.read_only
