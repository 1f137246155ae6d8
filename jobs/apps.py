from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Connect the receivers of signals sent by this app and by the fleet below it.
        from jobs import dependencies, diagnosing, notify, pipelines, receivers, sweeps, tracking  # noqa: F401
