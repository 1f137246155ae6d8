from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from fleet.models import Node
from fleet.operator import ACTIONS, OperatorError, change_state


class Command(BaseCommand):
    help = (
        "Cordon, drain or uncordon a node, with a reason (audited). Uncordoning an auto-cordoned node runs a burn-in."
    )

    def add_arguments(self, parser):
        parser.add_argument("action", choices=ACTIONS)
        parser.add_argument("node", help="node name")
        parser.add_argument("--reason", required=True, help="why: it goes in the audit trail")
        parser.add_argument("--by", help="the operator's username (recorded as who did it)")
        parser.add_argument("--override", action="store_true", help="uncordon without burn-in (audited as override)")

    def handle(self, *args, action, node, reason, by, override, **options):
        target = Node.objects.filter(name=node).first()
        if target is None:
            raise CommandError(f"no node named {node!r}; see the fleet page or GET /api/v1/nodes/")
        user = None
        if by:
            user = get_user_model().objects.filter(username=by).first()
            if user is None:
                raise CommandError(f"no user named {by!r}")
        try:
            outcome = change_state(target, action, user, reason, override=override)
        except OperatorError as exc:
            raise CommandError(str(exc))
        if not outcome.changed:
            raise CommandError(outcome.message)
        self.stdout.write(outcome.message)
