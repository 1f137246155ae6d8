from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "fleet"
    verbose_name = "Fleet"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from fleet.models import XidPolicy

        # After `migrate`, and after a `flush` (tests that empty the database): the default Xid table.
        post_migrate.connect(XidPolicy.ensure_defaults, sender=self, dispatch_uid="hangar.default_xid_policy")
