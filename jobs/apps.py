from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Connect the receivers of signals sent by this app and by the fleet below it.
        from django.db.models.signals import post_migrate

        from jobs import dependencies, diagnosing, notify, pipelines, receivers, sweeps, tracking  # noqa: F401
        from jobs.models.environment import ensure_built_in

        # After `migrate`, and after a `flush` (tests that empty the database): the built-in environments.
        post_migrate.connect(ensure_built_in, sender=self, dispatch_uid="hangar.built_in_environments")
