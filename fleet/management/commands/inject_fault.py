from django.core.management.base import BaseCommand, CommandError

from fleet.gpus import FAULT_KINDS
from fleet.models import Node
from fleet.operator import OperatorError, inject_fault


class Command(BaseCommand):
    help = "Inject a fault on a simulated node; its running agent applies it at its next heartbeat."

    def add_arguments(self, parser):
        parser.add_argument("node", help="node name")
        parser.add_argument("kind", choices=FAULT_KINDS)
        parser.add_argument("--gpu", type=int, help="GPU index (default: every GPU)")
        parser.add_argument("--xid", type=int, help="Xid number for kind xid (default 79)")
        parser.add_argument("--seconds", type=float, default=30.0, help="how long throttling or silence lasts")

    def handle(self, *args, node, kind, gpu, xid, seconds, **options):
        target = Node.objects.filter(name=node).first()
        if target is None:
            raise CommandError(f"no node named {node!r}")
        try:
            fault = inject_fault(target, kind, None, gpu, xid, seconds)
        except OperatorError as exc:
            raise CommandError(str(exc))
        where = f"GPU {gpu}" if gpu is not None else "every GPU"
        self.stdout.write(f"fault {fault.pk}: {kind} queued for {target.name} ({where})")
