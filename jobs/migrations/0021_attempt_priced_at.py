from django.db import migrations, models
from django.db.models import F


def ended_attempts_were_priced(apps, schema_editor):
    """Before this, an attempt's cost was added in the transaction that ended it."""
    Attempt = apps.get_model("jobs", "Attempt")
    Attempt.objects.filter(finished_at__isnull=False).update(priced_at=F("finished_at"))


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0006_cached_environments"),
        ("jobs", "0020_job_state_project"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="priced_at",
            field=models.DateTimeField(
                blank=True, help_text="Its cost was added to its job's and the day's (jobs/settling.py).", null=True
            ),
        ),
        migrations.RunPython(ended_attempts_were_priced, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name="attempt",
            index=models.Index(
                condition=models.Q(("finished_at__isnull", False), ("priced_at", None)),
                fields=["finished_at"],
                name="attempt_unsettled",
            ),
        ),
    ]
