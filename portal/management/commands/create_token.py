from decimal import Decimal

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from portal.models import LIMIT_FIELDS, ApiToken, Project


class Command(BaseCommand):
    help = "Create an API token for a user and print it (it is shown only this once)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")
        parser.add_argument("--project", help="limit the token to this project (its slug)")
        parser.add_argument("--read-only", action="store_true", help="the token may only read")
        parser.add_argument("--max-running-jobs", type=int, help="unfinished jobs (queued or running) at once")
        parser.add_argument("--max-gpus", type=int, help="GPUs its unfinished jobs hold at once")
        parser.add_argument("--max-gpu-hours-per-day", type=Decimal, help="GPU-hours a UTC day")
        parser.add_argument("--max-spend-per-day", type=Decimal, help="spend a UTC day")

    def handle(self, *args, username, name, project, read_only, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}; create one with `manage.py createsuperuser` or the admin")
        limit = None
        if project:
            limit = Project.objects.visible_to(user).filter(slug=project).first()
            if limit is None:
                raise CommandError(f"{username} is not in a project {project!r}")
        limits = {field: options.get(field) for field in LIMIT_FIELDS}
        if negative := [f"--{f.replace('_', '-')}" for f, v in limits.items() if v is not None and v < 0]:
            raise CommandError(f"{', '.join(negative)} must be 0 or more (leave it out for no limit)")
        _, raw = ApiToken.issue(user, name, project=limit, read_only=read_only, **limits)
        self.stdout.write(raw)
