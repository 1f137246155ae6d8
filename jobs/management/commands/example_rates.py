from django.core.management.base import BaseCommand

from jobs.models import GpuRate


class Command(BaseCommand):
    help = "On a fleet with no GPU-hour rate at all, add example rates (labelled as examples) for common GPU types."

    def handle(self, *args, **options):
        seeded = GpuRate.seed_examples()
        if seeded:
            self.stdout.write(f"example GPU-hour rates for {', '.join(seeded)} (replace them in the admin)")
