import sys

from django.core.management.base import BaseCommand

from jobs.models import Environment, EnvironmentKind

NAME = "hangar-venv"


class Command(BaseCommand):
    help = (
        "Register the virtualenv this Hangar runs in as the host environment `hangar-venv` "
        "(its python, with what was installed there), for the local agent to advertise."
    )

    def handle(self, *args, **options):
        if sys.prefix == sys.base_prefix:
            return  # not in a virtualenv: a job's python is the host's either way
        Environment.objects.update_or_create(
            name=NAME,
            defaults={
                "kind": EnvironmentKind.HOST,
                "path": sys.prefix,
                "description": f"the virtualenv Hangar runs in ({sys.prefix}): its python and packages",
                "everywhere": False,
            },
        )
        self.stdout.write(f"host environment {NAME}: {sys.prefix} (jobs: --environment {NAME})")
