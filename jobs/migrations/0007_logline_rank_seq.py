from django.db import migrations, models


class Migration(migrations.Migration):
    """Lines get their rank's own number, so a batch stored twice is recognised (idempotent ingest).

    Lines stored before this take their seq as rank_seq: unique within the
    attempt, so unique within its rank too, and in the order they were stored.
    The cursor index becomes unique and replaces (attempt, seq): one index
    fewer to maintain per inserted line for the one added.
    """

    dependencies = [
        ("jobs", "0006_secret_env_encrypted"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="logline", name="log_seq_unique"),
        migrations.RemoveIndex(model_name="logline", name="log_job_cursor"),
        migrations.AddConstraint(
            model_name="logline",
            constraint=models.UniqueConstraint(fields=("job", "attempt", "seq"), name="log_cursor_unique"),
        ),
        migrations.AddField(
            model_name="logline",
            name="rank_seq",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.RunSQL("UPDATE jobs_logline SET rank_seq = seq", migrations.RunSQL.noop),
        migrations.AddConstraint(
            model_name="logline",
            constraint=models.UniqueConstraint(fields=("attempt", "rank", "rank_seq"), name="log_rank_seq_unique"),
        ),
    ]
