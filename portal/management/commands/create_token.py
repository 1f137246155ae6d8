from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from portal.models import ApiToken, Project


class Command(BaseCommand):
    help = "Create an API token for a user and print it (it is shown only this once)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")
        parser.add_argument("--project", help="limit the token to this project (its slug)")
        parser.add_argument("--read-only", action="store_true", help="the token may only read")

    def handle(self, *args, username, name, project, read_only, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}; create one with `manage.py createsuperuser` or the admin")
        limit = None
        if project:
            limit = Project.objects.visible_to(user).filter(slug=project).first()
            if limit is None:
                raise CommandError(f"{username} is not in a project {project!r}")
        _, raw = ApiToken.issue(user, name, project=limit, read_only=read_only)
        self.stdout.write(raw)
