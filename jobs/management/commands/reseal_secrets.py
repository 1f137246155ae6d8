"""Encrypt every stored job secret again with the first key of HANGAR_SECRETS_KEY: the
step of a key rotation after which the old keys may be dropped from the setting."""

from django.core.management.base import BaseCommand, CommandError

from jobs.models import Job


class Command(BaseCommand):
    help = __doc__

    def handle(self, *args, **options):
        resealed, unreadable = 0, []
        for job in Job.objects.exclude(secret_env={}).only("pk", "secret_env").iterator():
            if any(value is None for value in job.secret_env.values()):
                unreadable.append(job.pk)
                continue
            job.save(update_fields=["secret_env"])  # the field seals with the first key on every save
            resealed += 1
        self.stdout.write(f"{resealed} jobs' secrets encrypted with the first key of HANGAR_SECRETS_KEY")
        if unreadable:
            raise CommandError(
                f"no configured key decrypts the secrets of jobs {', '.join(map(str, unreadable))}; "
                "they were left as they are: add the key they were sealed with and run this again"
            )
